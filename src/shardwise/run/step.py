"""One optimizer step, the per-step figures kept on the device until a log step, and evaluation.

Loss normalisation: each micro-batch contributes (sum of its token losses) / (global target tokens
of the step), and every data-parallel reduction is a plain sum, so micro-batching and sharding
never change the objective and no rank count is ever divided out.

Host synchronisation: a step reads exactly one value on the host — whether the global gradient
norm is finite, which decides whether the update happens (and, under fp16, the loss scale). The
loss and the norm stay device tensors in `StepLog` until a log step (or a non-finite step, or the
last step) reads all pending steps with one all-reduce and one copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from shardwise.data.loader import Batch
from shardwise.models.aux_loss import aux_loss_scale
from shardwise.models.plan import IGNORE_INDEX
from shardwise.parallel.expert import end_step
from shardwise.parallel.invariant import invariant_grad_norm
from shardwise.parallel.parallelize import ParallelModel
from shardwise.resilience.faults import FaultInjector
from shardwise.run.loss_scale import LossScaler
from shardwise.run.optim import Optimizers, global_grad_norm


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based number of the step just completed
    lr: float
    tokens: int  # global target tokens of the step
    skipped: bool = False  # inf/NaN gradients: no update was made
    loss_scale: float = 1.0
    loss_sum: torch.Tensor | None = None  # this rank's share of the loss sum (device, float64)
    norm: torch.Tensor | None = None  # global gradient norm before clipping (device)
    loss: float | None = None  # global mean token loss of the step, once resolved
    grad_norm: float | None = None  # the norm (after unscaling under fp16), once resolved
    # MoE: {module name: routing figures of the step} (parallel.expert.end_step), else None
    experts: dict | None = None

    @property
    def resolved(self) -> bool:
        return self.loss is not None


def counted(pm: ParallelModel, local: torch.Tensor) -> torch.Tensor:
    """This rank's contribution to a global sum of loss figures: the last pipeline stage holds
    the loss and every tp rank holds the same one, so only tp rank 0 of the last stage counts.
    Every cp rank counts: each holds the loss of its own chunks of the sequences."""
    if pm.holds_last_stage and pm.tp_rank == 0:
        return local.detach().double()
    return torch.zeros(local.shape, dtype=torch.float64, device=pm.ctx.device)


def global_sums(pm: ParallelModel, values: torch.Tensor) -> torch.Tensor:
    """Sum over the world of a vector of per-rank contributions (one all-reduce)."""
    if pm.ctx.distributed and pm.ctx.world_size > 1:
        dist.all_reduce(values)
    return values


class StepLog:
    """Steps whose loss and gradient norm are still on the device."""

    def __init__(self, pm: ParallelModel) -> None:
        self.pm = pm
        self.pending: list[StepResult] = []

    def add(self, result: StepResult) -> None:
        self.pending.append(result)

    def resolve(self) -> list[StepResult]:
        """Every pending step with `loss` and `grad_norm` filled in (collective: all ranks call
        it at the same steps; one all-reduce and one device-to-host copy for all of them)."""
        pending, self.pending = self.pending, []
        if not pending:
            return []
        sums = global_sums(self.pm, torch.stack([r.loss_sum for r in pending]))
        norms = torch.stack([r.norm.double() for r in pending])
        counts = torch.stack([torch.as_tensor(r.tokens, dtype=torch.float64,
                                              device=sums.device) for r in pending])
        values = torch.cat([sums, norms, counts]).tolist()
        n = len(pending)
        return [dataclasses.replace(r, loss=values[i] / values[2 * n + i], grad_norm=values[n + i],
                                    tokens=int(values[2 * n + i])) for i, r in enumerate(pending)]


def real_targets(pm: ParallelModel, batches: Sequence[Batch]) -> torch.Tensor:
    """The step's global count of real targets (those not IGNORE_INDEX), on the device: this
    data-parallel rank's micro-batches counted and summed over dp (one all-reduce of one number;
    tensor- and pipeline-parallel peers hold the same micro-batches)."""
    count = torch.zeros((), dtype=torch.float64, device=pm.ctx.device)
    for _, targets in batches:
        count += (targets != IGNORE_INDEX).sum()
    group = pm.ctx.dp_group() if pm.ctx.distributed and pm.ctx.dims.dp > 1 else None
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def train_step(pm: ParallelModel, optimizers: Optimizers, batches: Sequence[Batch],
               global_tokens: int | None, *, step: int, lr: float, grad_clip: float,
               scaler: LossScaler | None, faults: FaultInjector | None = None,
               on_phase: Callable[[str, int], None] | None = None) -> StepResult:
    """One optimizer step. `on_phase(phase, step)` is told when the optimizer phase starts (the
    model's own phase hook reports forward and backward); without it, `faults` is.

    The objective is the sum of per-target losses over the step's global count of real targets,
    whatever the micro-batching: `global_tokens` when the data knows it (packed text: every
    target is real), else counted here (targets equal to IGNORE_INDEX are padding)."""
    pm.train()
    optimizers.set_lr(lr)
    scale = scaler.scale if scaler else 1.0
    if global_tokens is None:
        global_tokens = real_targets(pm, batches)
        loss_scale = (scale / global_tokens).float()  # fp32, as a Python scale would act
    else:
        loss_scale = scale / global_tokens
    if not pm.invariant and not (faults is not None and faults.poisons_gradients(step + 1)):
        # (a planted NaN must be in the gradients that are reduced: nothing starts early)
        optimizers.arm(len(batches))
    with aux_loss_scale(loss_scale):  # a model's auxiliary losses (MoE) scale like the loss
        local_sum = pm.forward_backward(batches, loss_scale)
    _reduce_partial_grads(pm)
    if faults is not None:
        faults.after_backward(step + 1, pm.parameters())
    optimizers.reduce_grads()
    norm = invariant_grad_norm(pm.parameters()) if pm.invariant else \
        global_grad_norm(pm, optimizers.norm_grads())
    if scaler is not None:
        norm = norm / scale  # the norm of the unscaled gradients
    skipped = not bool(torch.isfinite(norm))  # the step's one host sync: update or not
    current_scale = scale
    if scaler is not None:
        skipped = scaler.update(skipped)
    if not skipped:
        # unscaling (fp16) and clipping in one pass over the gradients
        factor = torch.clamp(grad_clip / (norm + 1e-6), max=1.0) if grad_clip > 0 else None
        if scaler is not None:
            factor = factor / scale if factor is not None else 1.0 / scale
        if factor is not None:
            optimizers.scale_grads(factor)
        if on_phase is not None:
            on_phase("optimizer", step + 1)
        elif faults is not None:
            faults.at("optimizer", step + 1)
        optimizers.step()
    optimizers.zero_grad()
    experts = end_step(pm, updated=not skipped)  # non-gradient updates (MoE selection bias)
    return StepResult(step + 1, lr, global_tokens, skipped, current_scale,
                      loss_sum=counted(pm, local_sum.reshape(())), norm=norm.detach(),
                      experts=experts or None)


def _reduce_partial_grads(pm: ParallelModel) -> None:
    """Sequence-parallel norm weights end backward with Partial(sum) gradients; every later op
    (norm, AdamW's moments) would all-reduce them again. Reduce each once, here."""
    for p in pm.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                for pl in g.placements])


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean held-out loss per real target
    targets: int  # real targets counted, all ranks together
    accuracy: float | None  # top-1 over real targets; None when outputs are not class scores


@torch.no_grad()
def evaluate(pm: ParallelModel, batches: Iterable[tuple[Batch, bool]]) -> EvalResult:
    """Held-out loss (and top-1 accuracy) over every rank's share of the evaluation set, divided
    by the global count of real targets. Batches marked `False` are padding (a rank with fewer
    real micro-batches still runs the collectives of every forward) and are not counted."""
    pm.eval()
    # loss sum, real targets, correct top-1 predictions, batches whose outputs are not scores
    sums = torch.zeros(4, dtype=torch.float64, device=pm.ctx.device)
    for (inputs, full_targets), real in batches:
        # this rank's share of the sequence under context parallel (counted on every cp rank)
        outputs, targets = pm.sequence_logits(inputs, full_targets)
        if outputs is not None and real:
            real_mask = targets != IGNORE_INDEX
            sums[0] += pm.token_loss_sum(outputs, targets).double()
            sums[1] += real_mask.sum()
            correct = top1_correct(outputs, targets, real_mask)
            if correct is None:
                sums[3] += 1
            else:
                sums[2] += correct
    pm.train()
    loss_sum, count, correct, unscored = global_sums(pm, counted(pm, sums)).tolist()
    return EvalResult(loss=loss_sum / count, targets=int(count),
                      accuracy=None if unscored or not count else correct / count)


def top1_correct(outputs: object, targets: torch.Tensor,
                 real: torch.Tensor) -> torch.Tensor | None:
    """Real targets the highest score names, for outputs that score classes along their last
    dimension (logits of (..., C) for integer targets of (...)); None for any other outputs."""
    if not (isinstance(outputs, torch.Tensor) and not targets.is_floating_point()
            and outputs.shape[:-1] == targets.shape):
        return None
    return ((outputs.argmax(-1) == targets) & real).sum()
