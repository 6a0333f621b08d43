"""One optimizer step, and evaluation.

Loss normalisation: each micro-batch contributes (sum of its token losses) / (global target tokens
of the step), so micro-batching and sharding never change the objective. Data-parallel wrappers
average gradients over the dp degree; multiplying the loss by that degree turns the mean back
into a sum (exact for powers of two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from shardwise.data.loader import Batch
from shardwise.parallel.invariant import invariant_grad_norm
from shardwise.parallel.parallelize import ParallelModel
from shardwise.resilience.faults import FaultInjector
from shardwise.run.loss_scale import LossScaler
from shardwise.run.optim import Optimizers, clip_grads, global_grad_norm


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based number of the step just completed
    loss: float  # global mean token loss of the step
    grad_norm: float  # global norm before clipping (after unscaling under fp16)
    lr: float
    tokens: int  # global target tokens of the step
    skipped: bool = False  # fp16 found inf/NaN: no update was made
    loss_scale: float = 1.0


def global_sum(pm: ParallelModel, local: torch.Tensor) -> float:
    """Sum over data-parallel ranks of a per-rank loss sum that every tp rank and only the
    last pipeline stage holds: one all-reduce over the world, each value counted once."""
    if not pm.ctx.distributed:
        return float(local)
    counted = pm.holds_last_stage and pm.tp_rank == 0
    value = local.detach().double().reshape(1) if counted else \
        torch.zeros(1, dtype=torch.float64, device=pm.ctx.device)
    dist.all_reduce(value)
    return float(value)


def train_step(pm: ParallelModel, optimizers: Optimizers, batches: Sequence[Batch],
               global_tokens: int, *, step: int, lr: float, grad_clip: float,
               scaler: LossScaler | None, faults: FaultInjector | None = None,
               on_phase: Callable[[str, int], None] | None = None) -> StepResult:
    """One optimizer step. `on_phase(phase, step)` is told when the optimizer phase starts (the
    model's own phase hook reports forward and backward); without it, `faults` is."""
    pm.train()
    optimizers.set_lr(lr)
    # Backend reductions average over dp; invariant mode sums itself, so no correction there.
    dp_correction = 1 if pm.invariant else pm.ctx.dims.dp
    loss_scale = dp_correction / global_tokens * (scaler.scale if scaler else 1.0)
    local_sum = pm.forward_backward(batches, loss_scale)
    _reduce_partial_grads(pm)
    if faults is not None:
        faults.after_backward(step + 1, pm.parameters())
    found_inf = scaler.unscale_(pm.parameters(), pm.ctx.distributed) if scaler else False
    total = invariant_grad_norm(pm.parameters()) if pm.invariant else global_grad_norm(pm)
    skipped = not bool(torch.isfinite(total))  # NaN/inf anywhere: no update from this step
    if scaler is not None:
        current_scale = scaler.scale
        skipped = scaler.update(found_inf or skipped)
    if not skipped:
        clip_grads(pm, grad_clip, total)
        if on_phase is not None:
            on_phase("optimizer", step + 1)
        elif faults is not None:
            faults.at("optimizer", step + 1)
        optimizers.step()
    optimizers.zero_grad()
    loss = global_sum(pm, local_sum) / global_tokens
    return StepResult(step + 1, loss, float(total), lr, global_tokens, skipped,
                      current_scale if scaler else 1.0)


def _reduce_partial_grads(pm: ParallelModel) -> None:
    """Sequence-parallel norm weights end backward with Partial(sum) gradients; every later op
    (norm, AdamW's moments) would all-reduce them again. Reduce each once, here."""
    for p in pm.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                for pl in g.placements])


@torch.no_grad()
def evaluate(pm: ParallelModel, batches: Iterable[Batch], num_tokens: int) -> float:
    """Mean held-out token loss over every rank's share of the evaluation set."""
    pm.eval()
    total = torch.zeros((), dtype=torch.float64, device=pm.ctx.device)
    for inputs, targets in batches:
        logits = pm.logits(inputs)
        if logits is not None:
            total += pm.token_loss_sum(logits, targets).double()
    pm.train()
    return global_sum(pm, total) / num_tokens
