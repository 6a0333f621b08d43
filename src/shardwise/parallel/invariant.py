"""Invariant reductions: the bits of every update are the same whatever the data-parallel degree.

A step has M micro-batches (global indices 0..M-1); micro-batch j runs on data-parallel rank
j mod D, so round a (each rank's a-th micro-batch) holds the D consecutive micro-batches
aD..aD+D-1. Every gradient element is summed in ONE fixed binary tree over j:
  - within a round, the D per-rank gradients are reduce-scattered by an all-to-all of chunks
    followed by a pairwise sum in rank order (the same bytes on the wire as a ring);
  - across rounds, the round results are accumulated pairwise (a binary counter).
With M and D powers of two this is the complete pairwise tree over 0..M-1 for every D, so
dp = 1, 2, 4, DDP, ZeRO-1/2/3 and HSDP produce identical gradients; AdamW is elementwise, and the
global gradient norm is summed per dim-0 row in a fixed order, so the updates match too.
Each micro-batch gradient must itself be the same computation everywhere: same shapes (fixed
micro_batch), one intra-op thread per rank, deterministic kernels, fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardwise.parallel.collectives import all_gather_flat


def pairwise_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum(tensors) as a balanced binary tree: (t0 + t1) + (t2 + t3), …"""
    if len(tensors) == 1:
        return tensors[0]
    half = len(tensors) // 2
    return pairwise_sum(tensors[:half]) + pairwise_sum(tensors[half:])


class PairwiseAccumulator:
    """Sums a stream of values in a balanced binary tree (a binary counter of partial sums), so
    that 2^k values pushed one by one give exactly `pairwise_sum` of them."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, list[torch.Tensor]]] = []

    def push(self, values: list[torch.Tensor]) -> None:
        level, current = 0, values
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            current = [a + b for a, b in zip(left, current, strict=True)]
            level += 1
        self._stack.append((level, current))

    def result(self) -> list[torch.Tensor]:
        if len(self._stack) != 1:
            raise RuntimeError(f"pairwise accumulation needs a power-of-two count of values; "
                               f"{len(self._stack)} partial sums are left")
        return self._stack.pop()[1]


def tree_reduce_scatter(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row k of `flat` viewed as (D, n) summed over ranks in pairwise rank order, on rank k."""
    world = dist.get_world_size(group)
    chunks = flat.view(world, -1)
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return pairwise_sum(list(received.unbind(0)))


class TreeReduceScatter:
    """FSDP2 custom reduce-scatter (see `FSDPModule.set_custom_reduce_scatter`) that sums in the
    fixed pairwise tree instead of the backend's ring order."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object = None, async_op: bool = False) -> None:
        output_tensor.copy_(tree_reduce_scatter(input_tensor, group))


def install_on_fsdp(module: torch.nn.Module) -> None:
    """Make every FSDP2 module of `module` reduce with the pairwise tree and without dividing."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            if not hasattr(sub, "set_custom_reduce_scatter"):
                raise RuntimeError("determinism = \"invariant\" with FSDP needs torch >= 2.10 "
                                   "(FSDPModule.set_custom_reduce_scatter)")
            # torch types the argument as its ReduceScatter ABC; TreeReduceScatter provides that
            # interface (allocate, __call__) without subclassing it
            sub.set_custom_reduce_scatter(TreeReduceScatter())  # type: ignore[arg-type]
            sub.set_gradient_divide_factor(1.0)


def invariant_grad_norm(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm with a fixed summation order: per parameter (in the given order), the sum of
    squares of each dim-0 row, gathered to the full row vector, then one pairwise sum over all
    rows. Shards split parameters only between rows, so every layout sums the same numbers in
    the same order. The row sums of all sharded parameters travel in one all-gather."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        device = next((p.device for p in params), torch.device("cpu"))
        return torch.zeros((), device=device)
    sharded = [g for g in grads if isinstance(g, DTensor)]
    gathered = iter(_gather_row_sums(sharded) if sharded else [])
    rows = [next(gathered) if isinstance(g, DTensor) else _row_sums(g) for g in grads]
    return _pairwise_vector_sum(torch.cat(rows)).sqrt()


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0] if t.ndim else 1
    if t.numel() == 0:
        return torch.zeros(rows, dtype=torch.float32, device=t.device)
    return t.float().pow(2).reshape(rows, -1).sum(1)


def _gather_row_sums(grads: list[DTensor]) -> list[torch.Tensor]:
    """Full per-row sums of squares of dim-0-sharded gradients (FSDP / HSDP), in one all-gather
    over the shard axis: each rank pads its rows of every parameter to ceil(rows / D)."""
    mesh = grads[0].device_mesh
    axis = next(i for i, pl in enumerate(grads[0].placements) if isinstance(pl, Shard))
    group = mesh.get_group(axis)
    world = mesh.size(axis)
    chunks = [-(-g.shape[0] // world) for g in grads]
    local = torch.cat([torch.cat([_row_sums(g.to_local()),
                                  torch.zeros(c - g.to_local().shape[0] if g.to_local().ndim else
                                              c - 1, device=g.to_local().device)])
                       for g, c in zip(grads, chunks, strict=True)])
    out = local.new_empty(world * local.numel())
    all_gather_flat(out, local, group)
    table = out.view(world, -1)
    result, offset = [], 0
    for g, c in zip(grads, chunks, strict=True):
        result.append(table[:, offset:offset + c].reshape(-1)[: g.shape[0]])
        offset += c
    return result


def _pairwise_vector_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum of a 1-D tensor as a balanced tree, independent of the kernel's own reduction order."""
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, v.new_zeros(1)])
        v = v[0::2] + v[1::2]
    return v.reshape(())
