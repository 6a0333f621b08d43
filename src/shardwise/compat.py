"""Every private torch symbol shardwise uses, imported here and nowhere else.

torch moves and renames its underscored names between releases (2.11 and 2.13 are supported), so
each one is named once, with why shardwise needs it and no public alternative serves, and
`tests/unit/test_compat.py` imports every one on the installed version and fails any other module
of the package that reaches a private torch name itself. A leaf: it imports only torch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# DTensor's spec object: the tensor-parallel linear layers build their gradient's spec once per
# parameter instead of letting `to_local()` recompute it on every backward.
from torch.distributed.tensor._dtensor_spec import DTensorSpec

# Where a rank's shard of a DTensor starts (uneven shards included): the meta-device replay
# keeps exactly the rank's slice of a parameter it rebuilds whole.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# FSDP2's placement for a tensor sharded on dim 0 over two axes: ZeRO-1's expert rows use it so
# their optimizer state checkpoints interchangeably with ZeRO-2/3.
from torch.distributed.tensor.placement_types import _StridedShard

# Running a module with substituted parameters (expert parallel calls the experts' forward on
# local shards); `torch.func.functional_call` would copy the module's state dict per call.
from torch.nn.utils.stateless import _reparametrize_module

# The meta-device recorder is a dispatch mode over every aten op, and walks op arguments.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = [
    "DTensorSpec", "TensorBase", "TorchDispatchMode", "TorchPatches", "_StridedShard",
    "_reparametrize_module",
    "clear_dtensor_caches", "compute_local_shape_and_global_offset", "foreach_mul_",
    "foreach_norm", "fsspec_reader", "fsspec_writer", "functional_collectives",
    "in_autograd_thread", "resolve_process_group", "side_group", "tree_flatten", "tree_leaves",
    "tree_map",
]

# The tensor base class whose `is_meta` property the meta-device recorder answers as the eager
# build would (for `torch.nn.init` and user code) while it records.
TensorBase = torch._C.TensorBase

# The optimizer's clipping: one kernel launch for every gradient's norm and scale.
foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_


def functional_collectives() -> Any:
    """torch's functional collectives module (what DTensor issues): the comm tap wraps its
    functions, because DTensor never calls the public `torch.distributed` ones."""
    from torch.distributed import _functional_collectives

    return _functional_collectives


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The group a functional collective names by string (the comm tap maps it to a mesh axis)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)  # type: ignore[arg-type]  # GroupName is a str NewType


def in_autograd_thread() -> bool:
    """True on a thread that is running an autograd graph task (on CUDA: the engine's device
    threads, which run backward hooks and so issue FSDP's and DDP's gradient collectives)."""
    return torch._C._current_graph_task_id() != -1


def fsspec_reader() -> type:
    """DCP's reader over fsspec (object storage); needs `fsspec` installed."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader


def fsspec_writer() -> type:
    """DCP's writer over fsspec (object storage); needs `fsspec` installed."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter


def side_group(desc: str, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over the whole world for traffic that must never interleave with training's
    collectives (the background checkpoint writer, the preemption vote); `group_desc` names it
    in torch's logs where this torch takes the keyword (2.11 does not everywhere)."""
    kwargs: dict[str, Any] = {"backend": "gloo", "timeout": timedelta(seconds=timeout_s)}
    if "group_desc" in inspect.signature(dist.new_group).parameters:
        kwargs["group_desc"] = desc
    return dist.new_group(**kwargs)


def clear_dtensor_caches() -> None:
    """Empty torch's DTensor caches that hold meshes. They compare meshes by value (shape, ranks,
    axis names), not by process group, so after a group is destroyed a later run in the same
    process got the earlier run's mesh back on the outputs of cached ops. The C++ dispatch cache
    is not emptied by the Python cache's `cache_clear`. Each is looked up and skipped where this
    torch lacks it."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    topo = getattr(_collective_utils, "MeshTopoInfo", None)
    caches: tuple[Any, ...] = (getattr(propagator, "propagate_op_sharding", None),
                               getattr(_redistribute, "_gen_transform_infos", None),
                               getattr(topo, "build_from_mesh", None))
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


class TorchPatches:
    """The process-wide replacements shardwise makes on torch, made through one object that
    undoes them: the comm tap's collective wrappers (torch has no public hook that sees every
    collective with its group and size on every backend) and the meta-device build's
    `Tensor.is_meta` (a torch function mode does not see property reads). The worker enters one
    for the whole run (`shardwise.run.worker`), and on leaving it torch is as it found it,
    whatever failed in between; `scope()` undoes what was set inside it sooner.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, bool, Any]] = []  # owner, name, had own attr, value

    def set(self, owner: Any, name: str, value: Any) -> None:
        """Replace `owner.name` (a module's function, a class's attribute) until undone."""
        own = vars(owner)
        self._saved.append((owner, name, name in own, own.get(name)))
        setattr(owner, name, value)

    def undo_since(self, mark: int) -> None:
        """Put back everything set after `mark` (a `len(self)` taken earlier), newest first."""
        while len(self._saved) > mark:
            owner, name, had, value = self._saved.pop()
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)

    def __len__(self) -> int:
        return len(self._saved)

    @contextlib.contextmanager
    def scope(self) -> Iterator[TorchPatches]:
        mark = len(self)
        try:
            yield self
        finally:
            self.undo_since(mark)

    def __enter__(self) -> TorchPatches:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo_since(0)
