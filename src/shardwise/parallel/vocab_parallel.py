"""Vocabulary parallel: the embedding lookup of a vocabulary-sharded table (`VocabLookup`; the
embedding options it cannot honour are refused by `shardwise.models.plan.embedding_refusal`),
and the cross entropy of vocabulary-sharded logits (`vocab_parallel_loss_sum`, and torch's
`loss_parallel` context for code that calls F.cross_entropy on them: `loss_context`).

The tensor-parallel styles (`tensor_parallel.py`) shard the embedding's and the output
projection's rows by token id; these are the pieces that compute on those shards.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from shardwise.models.plan import IGNORE_INDEX
from shardwise.parallel.collectives import all_gather_flat

if TYPE_CHECKING:
    from shardwise.parallel.tp_collectives import TPRegion


class VocabLookup:
    """Vocabulary-parallel embedding: each rank looks up the tokens of its `rows` rows (zeros
    for the others); the reduction over tp (`reduce_output`) leaves every token's one real row.

    `padding_idx` (global, as the module has it): the padding row is looked up like any other
    (its values, which transformers initialises to zero), and its gradient is zero, as
    `nn.Embedding` makes it. The lookup runs the module's own forward on the local shard, so the
    row is given to it by its local index on the rank that holds it (`local_padding_idx`) and
    not at all on the others: there the global index would name another token's row, and the
    local row 0 that every other rank's token is looked up from gets no gradient anyway (its
    output is masked)."""

    def __init__(self, region: TPRegion, rows: int, padding_idx: int | None = None) -> None:
        self.region, self.rows = region, rows
        self.start = region.rank * rows
        self.local_padding_idx = local_row(padding_idx, self.start, rows)
        self.outside: list[torch.Tensor] = []  # per call in flight, for `combine`

    def local_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.rows)
        self.outside.append(outside)
        return local.masked_fill(outside, 0)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(self.outside.pop().unsqueeze(-1), 0.0)
        return self.region.reduce_output(out)

    def use_local_padding(self, module: nn.Embedding) -> None:
        """Hooks that give `module` this rank's padding index for the duration of each forward
        (`F.embedding` reads `module.padding_idx`) and put the global one back after it, also
        when the forward raises: outside the forward the module stays what it was built as."""
        held: list[int | None] = []  # a stack: safe under re-entrant calls

        def pre(_mod: nn.Module, _args: tuple) -> None:
            held.append(module.padding_idx)
            module.padding_idx = self.local_padding_idx

        def post(_mod: nn.Module, _args: tuple, _out: object) -> None:
            module.padding_idx = held.pop()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post, always_call=True)


def local_row(row: int | None, start: int, rows: int) -> int | None:
    """`row` (a global vocabulary row, or None) as an index into the shard of `rows` rows that
    starts at `start`; None when another shard holds it."""
    if row is None or not start <= row < start + rows:
        return None
    return row - start


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Where F.cross_entropy on the vocabulary-sharded logits DTensor is valid (torch's
    loss_parallel), for code that calls it; `vocab_parallel_loss_sum` is the fast path."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def vocab_parallel_loss_sum(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross entropy of vocabulary-sharded logits (a `Shard(-1)` DTensor
    of shape (..., vocab)), in fp32, as a plain scalar equal on every tp rank — the number
    `F.cross_entropy(full_logits.float(), targets, reduction="sum")` gives, without gathering
    the logits and without DTensor's per-op dispatch (torch's loss_parallel: ~2.5 ms more per
    micro-batch on CPU and three collectives; this: one all-gather of 2 values per token)."""
    mesh = logits.device_mesh
    local = logits.to_local()
    start = mesh.get_local_rank() * local.shape[-1]
    return _VocabParallelCrossEntropy.apply(local.flatten(0, -2).float(), targets.flatten(),
                                            start, mesh.get_group(), mesh.size())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """loss = logsumexp over the whole vocabulary − z_target, with one collective per call:
    each rank's log-sum-exp over its shard (stable with its own max) and its target logit (0
    where the target is another rank's) are all-gathered, and every rank combines them —
    logsumexp over ranks, sum over ranks. Megatron's version all-reduces the max first and
    then the exp-sums and target logits: two collectives of the same size."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int,
                group: dist.ProcessGroup, size: int) -> torch.Tensor:
        peak = logits.max(dim=-1).values
        exp = (logits - peak.unsqueeze(-1)).exp_()
        local = targets - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = logits.gather(-1, index).squeeze(-1).masked_fill(~inside, 0.0)
        stats = torch.stack([peak + exp.sum(dim=-1).log(), picked])
        every = stats.new_empty((size, *stats.shape))
        all_gather_flat(every.view(-1), stats.view(-1), group)
        lse = torch.logsumexp(every[:, 0], dim=0)
        valid = targets != IGNORE_INDEX
        softmax = exp.mul_((peak - lse).exp_().unsqueeze(-1))  # exp(z - lse)
        ctx.save_for_backward(softmax, index, inside & valid, valid)
        return ((lse - every[:, 1].sum(dim=0)) * valid).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, hit, valid = ctx.saved_tensors
        g = softmax * (grad * valid).unsqueeze(-1)
        g.scatter_add_(-1, index, -(grad * hit).unsqueeze(-1).to(g.dtype))
        return g, None, None, None, None
