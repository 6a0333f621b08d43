"""How the comm tap sees the calls: one wrapper per collective of torch, set for the life of a run.

`CommTap.install()` wraps the public functions of `torch.distributed` and of
`torch.distributed._functional_collectives` (which DTensor uses) for the life of the run. Each
wrapper records the call and forwards its arguments unchanged; nothing in the caller's code is
patched. Torch's own users of those functions — FSDP2, DTensor/TP, pipelining, DCP — are counted
the same way as shardwise's. DDP's reducer calls the process group from C++, so DDP is given a
comm hook (`ddp_hook.py`) that issues its bucket all-reduce through the wrapped `all_reduce`.

A wrapper reads what the call moves (`calls.py`) and hands the call to its tap (`CommTap._call`,
in `tap.py`), which counts, checks, times and forwards it; a collective issued inside a counted
one is forwarded uncounted. The wrappers reach into their tap's state: they are its other half,
kept apart so that `tap.py` holds what happens to a call and this module where calls come from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardwise.compat import TorchPatches, functional_collectives
from shardwise.telemetry.comm.calls import C10D, FUNCOL, _arg, _Extract, _nbytes, _storage_key


class TapCalls(Protocol):
    """What a wrapper needs of its tap (`shardwise.telemetry.comm.tap.CommTap`): the call it
    hands each collective to, the per-thread re-entry flag, the functional results awaiting
    their wait. A protocol, so that the tap imports the wrappers and not the other way round."""

    _local: threading.local
    _awaiting: dict[int, Any]

    def _call(self, original: Callable, args: tuple, kwargs: dict, op: str, group: Any,
              nbytes: int, tensor: torch.Tensor | None, wire: float | None = None,
              gathered: bool = False, functional: bool = False) -> Any: ...


def wrap_torch(tap: TapCalls, patches: TorchPatches) -> None:
    """Set `tap`'s wrappers of torch's collectives through `patches` (undone with them)."""
    funcol = functional_collectives()
    from torch.distributed import distributed_c10d as c10d

    # One wrapper per function, set on every module that exports it: torch compares them
    # by identity (`P2POp` accepts only `isend` / `irecv`).
    for name, (op, extract, gpos) in C10D.items():
        _wrap(tap, patches, (c10d, dist), name, op, extract, gpos, gathered_by_size=False)
    for name, (op, extract, gpos, by_size) in FUNCOL.items():
        _wrap(tap, patches, (funcol,), name, op, extract, gpos, gathered_by_size=by_size,
              functional=True)
    _wrap_batch_p2p(tap, patches, (c10d, dist))
    _wrap_wait_tensor(tap, patches, funcol)


def _set(patches: TorchPatches, modules: tuple[Any, ...], name: str, original: Any,
         wrapper: Any) -> None:
    for module in modules:
        if getattr(module, name, None) is original:
            patches.set(module, name, wrapper)


def _wrap(tap: TapCalls, patches: TorchPatches, modules: tuple[Any, ...], name: str, op: str,
          extract: _Extract, gpos: int, gathered_by_size: bool, functional: bool = False) -> None:
    original = getattr(modules[0], name, None)
    if original is None or getattr(original, "__shardwise_tap__", False):
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(tap._local, "depth", 0):
            return original(*args, **kwargs)  # a collective inside a counted one
        nbytes, tensor = extract(args, kwargs)
        return tap._call(original, args, kwargs, op, _arg(args, kwargs, gpos, "group"), nbytes,
                         tensor, None, gathered_by_size, functional)

    wrapper.__shardwise_tap__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", name)
    wrapper.__doc__ = original.__doc__
    _set(patches, modules, name, original, wrapper)


def _wrap_batch_p2p(tap: TapCalls, patches: TorchPatches, modules: tuple[Any, ...]) -> None:
    original = getattr(modules[0], "batch_isend_irecv", None)
    if original is None or getattr(original, "__shardwise_tap__", False):
        return

    def batch_isend_irecv(p2p_op_list: list) -> Any:
        if getattr(tap._local, "depth", 0) or not p2p_op_list:
            return original(p2p_op_list)
        nbytes = sum(_nbytes(p.tensor) for p in p2p_op_list)
        sent = sum(_nbytes(p.tensor) for p in p2p_op_list
                   if getattr(p.op, "__name__", "") in ("isend", "send"))
        return tap._call(original, (p2p_op_list,), {}, "p2p", p2p_op_list[0].group, nbytes,
                         p2p_op_list[0].tensor, wire=sent)

    batch_isend_irecv.__shardwise_tap__ = True  # type: ignore[attr-defined]
    batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
    _set(patches, modules, "batch_isend_irecv", original, batch_isend_irecv)


def _wrap_wait_tensor(tap: TapCalls, patches: TorchPatches, funcol: Any) -> None:
    """A functional collective completes, for its consumer's stream, at `wait_tensor`
    (AsyncCollectiveTensor calls it on first use): the end event of a device-timed one goes
    there."""
    original = getattr(funcol, "wait_tensor", None)
    if original is None or getattr(original, "__shardwise_tap__", False):
        return

    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        out = original(tensor)
        if tap._awaiting and isinstance(tensor, torch.Tensor):
            call = tap._awaiting.pop(_storage_key(tensor), None)
            if call is not None:
                call.ends.append(call.clock.mark())
        return out

    wait_tensor.__shardwise_tap__ = True  # type: ignore[attr-defined]
    wait_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    wait_tensor.__doc__ = original.__doc__
    _set(patches, (funcol,), "wait_tensor", original, wait_tensor)
