"""The backend/device discipline: a collective's tensor must be on a device its group's backend
serves.

Before forwarding a call, the tap checks that the group's backend serves the tensor's device (a
CPU tensor on an NCCL group, a CUDA tensor on a gloo group) and raises `BackendDeviceError` naming
the op, the axis and the fix; the backend of each group is looked up once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.telemetry.comm.groups import _resolve


class BackendDeviceError(RuntimeError):
    """A collective's tensor is on a device its process group's backend does not serve."""


#: device types each backend serves in a shardwise run. torch's gloo also takes a few CUDA
#: collectives by staging them through the host; on a run that has NCCL that is a bug, not a plan.
_SERVES: dict[str, frozenset[str]] = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"})}


def devices_served(backend: str | None, device_types: Iterable[str] = ()) -> frozenset[str] | None:
    """The device types a group's backend takes; None when shardwise does not know (the `fake`
    and `threaded` test backends, MPI, UCC, plugins): those are never refused."""
    if not backend:
        return None
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    if backend == "undefined":  # init_process_group() without a backend: one per device it has
        return frozenset(device_types) or None
    return _SERVES.get(backend)


def _served_by(group: Any) -> frozenset[str] | None:
    """What the group's backend serves (the default lookup; tests inject their own)."""
    try:
        pg = _resolve(group)
        backend = str(dist.get_backend(pg))
        types = [d.type for d in getattr(pg or dist.group.WORLD, "_device_types", ())]
    except Exception:  # a group this rank is not in, an exotic form: no check
        return None
    return devices_served(backend, types)


def _device_type(tensor: torch.Tensor) -> str:
    # the two common answers without building a torch.device (5x slower): this is per call
    return "cpu" if tensor.is_cpu else "cuda" if tensor.is_cuda else tensor.device.type


def _device_error(op: str, where: str, tensor: torch.Tensor,
                  served: frozenset[str]) -> BackendDeviceError:
    return BackendDeviceError(
        f"{op} on {where} got a tensor on {tensor.device}, but the group's backend serves only "
        f"{', '.join(sorted(served))} tensors (a CPU tensor on an NCCL group fails at the first "
        "collective on a multi-GPU machine). Create the tensor on the run's device, ctx.device "
        "(e.g. torch.zeros(..., device=ctx.device)); for host-side data, use a gloo group instead.")
