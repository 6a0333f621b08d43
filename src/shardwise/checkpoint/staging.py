"""Staging for async checkpoints: the copy to host memory that the step loop waits for.

`dcp.async_save` calls the writer's `stage()` and then writes what it returns from a background
thread while training goes on, so the staged state must be a snapshot that shares nothing with
the live tensors and holds nothing on the device:

- one host buffer per tensor of the state dict (one for a tensor that appears under two names, like
  tied embeddings), kept by a `HostStager` that lives as long as the `Checkpointer`, reused on every
  save while the tensors' paths, shapes and dtypes are the same (rebuilt when they change, e.g.
  after the first optimizer step creates its state): no allocation per save, and no page faults on
  fresh memory;
- the buffers are pinned when CUDA is available, and device-to-host copies are issued with
  `non_blocking=True` and followed by one synchronisation per device before `stage()` returns
  (the writer thread reads them right after);
- a DTensor is staged as a DTensor of the same spec (mesh, placements, global shape) whose local
  tensor is the host buffer, built with the DTensor constructor. `DTensor.from_local` would move
  the local tensor back to the mesh's device, i.e. keep a second copy of the parameters and
  optimizer state in GPU memory until the save ends; DCP's own staging
  (`torch.distributed._state_dict_utils._create_cpu_state_dict`) likewise keeps a CPU local
  tensor on a device mesh, which its writers handle;
- a CPU tensor is still copied (into its buffer): DCP's own staging only moves tensors to the CPU
  in some torch versions, which on a CPU run aliases the parameters the next step overwrites;
- other values are taken as they are at this save (ints and strings as is, anything mutable
  deep-copied), never from a cache.

One save is staged at a time: the buffers are overwritten by the next `stage()`, so the caller
must not stage again while a writer still reads the previous snapshot (the Checkpointer waits
for the save in flight before it starts the next).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
TensorPath = tuple[Hashable, ...]  # where a tensor sits in the state dict: keys and indices


class HostStager:
    """Copies state dicts into reused host buffers (see the module docstring)."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: dict[TensorPath, torch.Tensor] = {}
        self._signature: tuple[Any, ...] | None = None
        self.builds = 0  # how often the buffers were (re)allocated

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the buffers (a shared one once)."""
        unique = {id(b): b for b in self._buffers.values()}.values()
        return sum(b.numel() * b.element_size() for b in unique)

    @torch.no_grad()
    def stage(self, state_dict: Any) -> Any:
        """A snapshot of `state_dict`, structure and values as they are now, in host buffers."""
        tensors: dict[TensorPath, torch.Tensor] = {}
        _collect(state_dict, (), tensors)
        owners = _owners(tensors)
        signature = tuple((path, tuple(t.shape), t.dtype, owners[path]) for path, t in tensors.items())
        if signature != self._signature:
            self._buffers = {}
            for path, live in tensors.items():  # a tied weight shares its owner's buffer
                owner = owners[path]
                self._buffers[path] = self._buffers[owner] if owner != path else self._allocate(live)
            self._signature = signature
            self.builds += 1
        devices = set()
        for path, live in tensors.items():
            if owners[path] != path:
                continue  # copied once, through its owner
            self._buffers[path].copy_(live, non_blocking=True)
            if live.device.type == "cuda":
                devices.add(live.device)
        for device in devices:  # the non-blocking copies are done before the writer reads
            torch.cuda.synchronize(device)
        return self._rebuild(state_dict, ())

    def _allocate(self, like: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        # pinning an empty tensor fails (and buys nothing)
        return buffer.pin_memory() if self.pin and buffer.numel() else buffer

    def _rebuild(self, obj: Any, path: TensorPath) -> Any:
        if isinstance(obj, DTensor):
            # The constructor, not from_local (which moves the local tensor to the mesh's device).
            return DTensor(self._buffers[path], obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._buffers[path]
        if isinstance(obj, dict):
            return {key: self._rebuild(value, (*path, key)) for key, value in obj.items()}
        if isinstance(obj, list | tuple):
            items = [self._rebuild(value, (*path, i)) for i, value in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, _IMMUTABLE):
            return obj
        return copy.deepcopy(obj)


def _owners(tensors: dict[TensorPath, torch.Tensor]) -> dict[TensorPath, TensorPath]:
    """For each path, the first path holding the very same tensor data (tied embeddings appear
    under two names): staged once, and the snapshot keeps the live state's sharing."""
    first: dict[tuple[Any, ...], TensorPath] = {}
    owners: dict[TensorPath, TensorPath] = {}
    for path, t in tensors.items():
        if t.numel() == 0 or t.data_ptr() == 0:
            owners[path] = path
            continue
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        owners[path] = first.setdefault(key, path)
    return owners


def _collect(obj: Any, path: TensorPath, out: dict[TensorPath, torch.Tensor]) -> None:
    """The live tensors of `obj` by path (a DTensor's local shard), in traversal order."""
    if isinstance(obj, DTensor):
        out[path] = obj._local_tensor  # not to_local(): an autograd op, and no_grad is enough
    elif isinstance(obj, torch.Tensor):
        out[path] = obj.detach()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _collect(value, (*path, key), out)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _collect(value, (*path, i), out)


class HostCopyStage:
    """Mixin for DCP writers: `dcp.async_save` stages through the writer's `stage()`, here into
    the host buffers of the checkpointer's `HostStager` (one for the writer alone without it)."""

    stager: HostStager | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.stager is None:
            self.stager = HostStager()
        return self.stager.stage(state_dict)
