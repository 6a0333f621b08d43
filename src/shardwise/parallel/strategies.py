"""How one training step's micro-batches run forward and backward on this rank: plainly (with
gradient sync on the last micro-batch), through the pipeline schedule, or in invariant mode's
fixed-tree order. `parallelize` chooses one, once; `ParallelModel.forward_backward` calls it.

Each returns this rank's local sum of token losses (float64). `loss_scale` multiplies each
micro-batch's loss sum before backward (1 / the step's global token count, times the fp16 loss
scale); every data-parallel reduction is a plain sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.parallel.collectives import all_gather_flat
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.invariant import PairwiseAccumulator, tree_reduce_scatter
from shardwise.parallel.pipeline import Pipeline
from shardwise.parallel.tied import TiedAcrossStages
from shardwise.parallel.vocab_parallel import loss_context

Batch = tuple[torch.Tensor, torch.Tensor]


class StepModel(Protocol):
    """What a strategy reads of the model it runs (`parallel.execution.ParallelModel` is one);
    a protocol, so that strategies and the container do not import each other."""

    parts: list[nn.Module]
    ctx: DistContext
    loss_parallel: bool
    pipeline: Pipeline | None
    tied: TiedAcrossStages | None

    def phase(self, name: str) -> None: ...
    def autocast(self) -> contextlib.AbstractContextManager: ...
    def context_active(self) -> contextlib.AbstractContextManager: ...
    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...
    def local_sequence(self, inputs: torch.Tensor, targets: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]: ...


class StepStrategy(Protocol):
    def __call__(self, pm: StepModel, batches: Sequence[Batch],
                 loss_scale: float) -> torch.Tensor: ...


class PlainStep:
    """One module: each micro-batch forward and backward, gradients synced on the last one
    (DDP's no_sync / FSDP's requires_gradient_sync on the others); context parallel runs each
    rank's zigzag chunks."""

    def __call__(self, pm: StepModel, batches: Sequence[Batch],
                 loss_scale: float) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=pm.ctx.device)
        model = pm.parts[0]
        for i, (full_inputs, full_targets) in enumerate(batches):
            inputs, targets, extra = pm.local_sequence(full_inputs, full_targets)
            with _grad_sync(model, enabled=i == len(batches) - 1), \
                    loss_context(pm.loss_parallel), pm.context_active():
                pm.phase("forward")
                with pm.autocast():
                    logits = model(inputs, **extra)
                loss_sum = pm.token_loss_sum(logits, targets)
                pm.phase("backward")
                (loss_sum * loss_scale).backward()
            total += _full_value(loss_sum.detach()).double()
        return total


class PipelineStep:
    """The pipeline schedule over every micro-batch at once; the sum is known only on the last
    stage (other ranks return 0). Tied tensors on different stages sum their gradients after."""

    def __call__(self, pm: StepModel, batches: Sequence[Batch],
                 loss_scale: float) -> torch.Tensor:
        assert pm.pipeline is not None
        total = torch.zeros((), dtype=torch.float64, device=pm.ctx.device)
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        # under context parallel: this rank's zigzag chunks (each stage adds their positions)
        inputs, targets, _ = pm.local_sequence(inputs, targets)
        pm.phase("forward")
        pm.phase("backward")  # the schedule interleaves both; a drill fires before it
        with pm.autocast(), pm.context_active():
            losses = pm.pipeline.run(inputs, targets)
        for loss in losses:
            total += loss.detach().double()
        if pm.tied is not None:
            pm.tied.sum_gradients()
        return total / loss_scale


class InvariantStep:
    """Round a = this rank's a-th micro-batch (global micro-batch aD + dp_rank): a fresh
    gradient, tree-reduced over the dp ranks of the round, accumulated pairwise over rounds (see
    parallel/invariant.py), so the bits do not depend on the data-parallel degree."""

    def __call__(self, pm: StepModel, batches: Sequence[Batch],
                 loss_scale: float) -> torch.Tensor:
        model = pm.parts[0]
        params = [p for p in model.parameters() if p.requires_grad]
        fsdp = isinstance(model, FSDPModule)
        group = pm.ctx.dp_group() if pm.ctx.dims.dp > 1 else None
        acc = PairwiseAccumulator()
        total = torch.zeros((), dtype=torch.float64, device=pm.ctx.device)
        for inputs, targets in batches:
            for p in params:
                p.grad = None
            if fsdp:  # FSDP reduces every round with the tree reduce-scatter installed on it
                cast(FSDPModule, model).set_requires_gradient_sync(True)
            pm.phase("forward")
            loss_sum = pm.token_loss_sum(model(inputs), targets)
            pm.phase("backward")
            (loss_sum * loss_scale).backward()
            total += loss_sum.detach().double()
            if fsdp:
                # every trainable parameter has a gradient after backward
                acc.push(cast(list[torch.Tensor], [p.grad for p in params]))
            else:
                flat = _flatten_grads(params, group.size() if group is not None else 1)
                acc.push([tree_reduce_scatter(flat, group) if group is not None else flat])
        reduced = acc.result()
        if fsdp:
            for p, g in zip(params, reduced, strict=True):
                p.grad = g
        else:
            shard = reduced[0]
            full = shard
            if group is not None:
                full = shard.new_empty(shard.numel() * group.size())
                all_gather_flat(full, shard, group)
            _unflatten_grads(params, full)
        return total


def _flatten_grads(params: list[nn.Parameter], world: int) -> torch.Tensor:
    """All gradients in one flat buffer (zeros for parameters without one), padded to a multiple
    of `world` so it splits into equal chunks."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    pad = -flat.numel() % world
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _unflatten_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def _full_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def _grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip gradient communication on accumulation micro-batches; sync on the last one."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    else:
        yield
