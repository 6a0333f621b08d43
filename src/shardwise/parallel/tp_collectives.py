"""The collectives between tensor-parallel modules, each an autograd function with its dual: the
tensor-parallel group of a model (`TPRegion`) and what it does between modules — Megatron's f
(`_CopyToRegion`: identity forward, all-reduce backward) and g (`_ReduceFromRegion`: all-reduce
forward, identity backward), and under sequence parallel the gather along the sequence and its
reduce-scatter dual.

They are hand-written on plain tensors, not DTensor redistributions: the compute between them is
on local shards, so the only DTensor work is at the parameters (see `tensor_parallel.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.parallel.collectives import all_gather_flat, reduce_scatter_flat

SEQ_DIM = 1  # activations are (batch, sequence, features)
Transform = Callable[[Any], Any]  # what a module's input or output goes through


@dataclass
class TPRegion:
    """The tensor-parallel group of a model and the collectives between its modules."""

    mesh: DeviceMesh
    sequence_parallel: bool
    group: dist.ProcessGroup = field(init=False)
    size: int = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        self.group, self.size = self.mesh.get_group(), self.mesh.size()
        self.rank = self.mesh.get_local_rank()

    _last_input: tuple[torch.Tensor, int, torch.Tensor] | None = field(default=None, init=False)

    def shared_full_input(self, x: torch.Tensor) -> torch.Tensor:
        """`full_input`, once for column-parallel modules that take the same tensor in a row
        (q, k and v; the MLP's gate and up projections): one collective for them together, as
        Megatron's fused QKV does, found by identity whatever the model's modules are called."""
        last = self._last_input
        if last is not None and last[0] is x and last[1] == x._version:
            return last[2]
        full = self.full_input(x)
        self._last_input = (x, x._version, full)
        return full

    def forget_input(self, x: Any) -> Any:
        """Any other parallel module ends a run of column-parallel modules (and frees the
        remembered activation)."""
        self._last_input = None
        return x

    def full_input(self, x: torch.Tensor) -> torch.Tensor:
        """A block's input as the full activation: all-gathered along the sequence (sequence
        parallel) or passed through with an all-reduced gradient (Megatron's f)."""
        if self.sequence_parallel:
            return _GatherSequence.apply(x, self.group, self.size)
        return _CopyToRegion.apply(x, self.group)

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """A rowwise module's partial output summed over tp: reduce-scattered along the
        sequence (sequence parallel) or all-reduced."""
        if self.sequence_parallel:
            return _ScatterSequence.apply(y, self.group, self.size)
        return _ReduceFromRegion.apply(y, self.group)

    def vocab_output(self, loss_par: bool) -> Transform:
        """The output projection's vocabulary-sharded logits: a `Shard(-1)` DTensor for the
        loss-parallel cross entropy, or all-gathered to the full logits."""
        if loss_par:
            return lambda y: DTensor.from_local(y, self.mesh, [Shard(y.dim() - 1)],
                                                run_check=False)
        return lambda y: _GatherLast.apply(y, self.group, self.size, self.rank)


def _gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    x = x.contiguous()
    out = x.new_empty((size, *x.shape))
    all_gather_flat(out.view(-1), x.view(-1), group)
    return out.movedim(0, dim).flatten(dim, dim + 1) if dim else out.flatten(0, 1)


def _scatter_sum(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Chunk `rank` along `dim` of the sum over ranks of `x`."""
    chunks = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    reduce_scatter_flat(out.view(-1), chunks.view(-1), group)
    return out


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ranks, into a new tensor (a gradient handed to backward may be shared with
    another branch of the graph, so it is never reduced in place)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather along the sequence; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _gather(x, SEQ_DIM, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _scatter_sum(grad, SEQ_DIM, ctx.group, ctx.size), None, None


class _GatherWhole(torch.autograd.Function):
    """Forward: all-gather along the sequence; backward: this rank's part of the gradient (which
    every rank computed whole and the same, see `_run_on_whole_sequence`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int
                ) -> torch.Tensor:
        ctx.size, ctx.rank = size, rank
        return _gather(x, SEQ_DIM, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.size, SEQ_DIM)[ctx.rank].contiguous(), None, None, None


class _OwnPart(torch.autograd.Function):
    """Forward: this rank's part along the sequence of an output every rank computed whole;
    backward: all-gather of the parts' gradients."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int
                ) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return y.chunk(size, SEQ_DIM)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, SEQ_DIM, ctx.group, ctx.size), None, None, None


class _ScatterSequence(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence; backward: all-gather of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _scatter_sum(x, SEQ_DIM, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather(grad, SEQ_DIM, ctx.group, ctx.size), None, None


class _CopyToRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Megatron's g: all-reduce forward (in place: its input is a row-parallel matmul's fresh
    output, which nothing saves for backward), identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        if not x.is_contiguous():
            return _all_reduce(x, group)
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherLast(torch.autograd.Function):
    """Forward: all-gather along the last dim (full logits); backward: this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int,
                rank: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, x.shape[-1]
        return _gather(x, x.dim() - 1, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width), None, None, None

