"""Materialise the tensors a rank keeps from a recorded build: allocate them on the device, fill
each with its share of the replayed value.

**Materialise** (`materialize`, after the model is split and sharded): `to_empty` on the target
device (parameters swapped in place, so tied parameters stay one object; FSDP2 re-points its
sharded storage in its `_apply`), then every local tensor is filled from its replayed full
value: a DTensor with the slice of the global tensor this rank holds (any Shard / Replicate on
any mesh, uneven shards included), a plain tensor with the whole value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from shardwise.compat import compute_local_shape_and_global_offset
from shardwise.models.deferred.buffers import _Pool
from shardwise.models.deferred.record import InitRecord
from shardwise.models.deferred.replay import _Replayer


@torch.no_grad()
def materialize(modules: Sequence[nn.Module], record: InitRecord,
                device: torch.device | str) -> None:
    """Allocate the meta tensors of `modules` (a model, or the pipeline stages a rank holds,
    already split and sharded) on `device` and fill each with its share of the recorded value."""
    replayer, pool = _Replayer(record), _Pool()
    for module in modules:
        _to_empty(module, torch.device(device))
        done: set[int] = set()
        for name, t in [*module.named_parameters(remove_duplicate=False),
                        *module.named_buffers(remove_duplicate=False)]:
            if id(t) in done:
                continue
            done.add(id(t))
            ref = record.finals.get(name)
            if ref is None:
                raise RuntimeError(f"materialize: {name} is not a tensor the recorded build made")
            with replayer.final(ref, pool) as full:
                _fill(name, t, full)


def _to_empty(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` keeping tied tensors one object: parameters are swapped in place
    (torch's `swap_module_params_on_conversion`), buffers shared by several modules re-shared."""
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for key, buf in mod._buffers.items():
            if buf is not None:
                shared.setdefault(id(buf), []).append((mod, key))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for holders in shared.values():
        first_mod, first_key = holders[0]
        for mod, key in holders[1:]:
            mod._buffers[key] = first_mod._buffers[first_key]


def _fill(name: str, t: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if tuple(full.shape) != tuple(t.shape):
        raise RuntimeError(f"materialize: {name} has shape {tuple(t.shape)}, the recorded build "
                           f"made {tuple(full.shape)}")
    if isinstance(t, DTensor):
        local = t._local_tensor
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
        if tuple(shape) != tuple(local.shape):
            raise RuntimeError(f"materialize: {name}'s local shard is {tuple(local.shape)}, its "
                               f"placements {t.placements} give {tuple(shape)}")
        if local.numel():
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
            local.copy_(full[index])
    else:
        t.copy_(full)
