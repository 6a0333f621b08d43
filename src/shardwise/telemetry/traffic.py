"""Bytes the elementwise kernels of a forward and backward move through memory.

A GPU's norms, activations, rotary embeddings, casts and residual adds are bound by memory
bandwidth, not FLOPs: each eager PyTorch op is its own kernel that reads its inputs from HBM and
writes its output back. `ElementwiseTraffic` is a dispatch mode that adds up those bytes, op by
op, for everything that is not a matmul or an attention kernel (those the planner times by their
FLOPs) and moves data (views move none). Run under it on any device: the aten ops autograd and
the modules issue are the same on a CPU, so the count describes the GPU run of the same code.

An input is counted at most at its storage's size (an expanded view reads its storage once); an
output at its size. The planner's eager elementwise model (`planner/elementwise.py`) quotes
these counts for the built-in block, and a test holds it to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.compat import TorchDispatchMode, tree_leaves

#: ops the planner times by FLOPs (GEMMs, fused attention) rather than by bytes
_TIMED_BY_FLOPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product", "scaled_dot_product",
                   "_flash_attention", "_efficient_attention", "_cudnn_attention")
#: ops that make views or allocate without touching memory
_NO_TRAFFIC = frozenset({
    "view", "_unsafe_view", "transpose", "t", "unsqueeze", "squeeze", "expand", "unflatten",
    "select", "slice", "alias", "detach", "as_strided", "permute", "unbind", "split",
    "split_with_sizes", "reshape", "flatten", "_reshape_alias", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "view_as_real",
    "view_as_complex", "_to_copy_noop", "is_same_size",
})


def _read_bytes(t: torch.Tensor) -> int:
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class ElementwiseTraffic(TorchDispatchMode):
    """Bytes read and written by the memory-bound ops run under it, total and by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name.startswith(_TIMED_BY_FLOPS) or name in _NO_TRAFFIC:
            return out
        moved = sum(_read_bytes(t) for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor))
        moved += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                     if isinstance(t, torch.Tensor))
        self.by_op[name] = self.by_op.get(name, 0) + moved
        return out


def forward_backward_bytes(forward: Callable[[], torch.Tensor],
                           grad: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) bytes of `forward()` and the backward of its output against `grad`,
    counted by `ElementwiseTraffic` (run `forward` under autocast inside it, if wanted)."""
    count = ElementwiseTraffic()
    with count:
        out = forward()
    fwd = count.total
    with count:
        out.backward(grad)
    return fwd, count.total - fwd
