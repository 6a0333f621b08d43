"""ParallelModel: the model as one rank holds it — its parts, the loss, the precision and
context-parallel contexts — and the entry points the trainer drives: `forward_backward` (through
the step strategy `parallelize` chose, parallel/strategies.py) and the forward-only `logits`
(pipeline stages over point-to-point sends, parallel/pipeline.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.models.plan import ModelPlan
from shardwise.parallel.context import ContextParallel
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.pipeline import Pipeline, forward_only
from shardwise.parallel.precision import autocast as precision_autocast
from shardwise.parallel.strategies import Batch, PlainStep, StepStrategy
from shardwise.parallel.tied import TiedAcrossStages
from shardwise.parallel.vocab_parallel import vocab_parallel_loss_sum

__all__ = ["Batch", "ParallelModel"]


@dataclass
class ParallelModel:
    """The model as this rank holds it: one part, or several pipeline stages, plus how to run it."""

    parts: list[nn.Module]
    ctx: DistContext
    precision: str
    plan: ModelPlan
    loss_parallel: bool = False
    sequence_parallel: bool = False
    invariant: bool = False  # gradients summed in one fixed tree (see parallel/invariant.py)
    # zero 0/1 under tensor or pipeline parallel: no DDP wrapper; the optimizers reduce the
    # gradients after the step's last backward (parallel/flat_dp.py)
    flat_dp: bool = False
    strategy: StepStrategy = field(default_factory=PlainStep)  # chosen once by parallelize
    pipeline: Pipeline | None = None
    stage_ids: list[int] = field(default_factory=lambda: [0])
    n_stages: int = 1
    schedule: str = ""
    phase_hook: Callable[[str], None] | None = None  # told "forward"/"backward" (fault drills)
    tied: TiedAcrossStages | None = None  # tied tensors on different pipeline stages
    context: ContextParallel | None = None  # cp > 1: each rank runs its zigzag chunks
    _loss_scale: float = 1.0

    # --- plain module-like helpers -----------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for part in self.parts:
            for p in part.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def counted_parameters(self) -> list[nn.Parameter]:
        """`parameters()` without the copies of tied tensors that pipeline stages hold twice
        (what the gradient norm and parameter counts count)."""
        mirrors = self.tied.mirrors if self.tied is not None else set()
        return [p for p in self.parameters() if id(p) not in mirrors]

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def eval(self) -> None:
        self.train(False)

    def phase(self, name: str) -> None:
        if self.phase_hook is not None:
            self.phase_hook(name)

    @functools.cached_property
    def tp_rank(self) -> int:
        """(Cached: slicing a mesh builds a new DeviceMesh, too slow for every step.)"""
        return self.ctx.mesh["tp"].get_local_rank() if self.ctx.mesh is not None else 0

    @property
    def holds_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    # --- training ------------------------------------------------------------------------------
    def forward_backward(self, batches: Sequence[Batch], loss_scale: float) -> torch.Tensor:
        """Run this rank's micro-batches with the strategy `parallelize` chose (plain, pipeline
        or invariant, see parallel/strategies.py); return its local sum of token losses
        (float64). Under pipeline parallel the sum is known only on the last stage; other
        ranks return 0."""
        self._loss_scale = loss_scale
        return self.strategy(self, batches, loss_scale)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """loss_fn of the pipeline schedule: the scaled token-loss sum of one micro-batch."""
        return self.token_loss_sum(output, target) * self._loss_scale

    def token_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum of per-target losses of one micro-batch (the plan's loss, or cross entropy in
        fp32 over the last dimension: next-token logits (B, T, V), class logits (B, C));
        targets equal to the ignore index count nothing."""
        if self.plan.loss is not None:
            return self.plan.loss(logits, targets)
        if isinstance(logits, DTensor):  # vocabulary-sharded (loss parallel)
            return vocab_parallel_loss_sum(logits, targets)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="sum")

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision policy's forward context, the same on every layout (parallel/precision)."""
        return precision_autocast(self.precision, self.ctx.device.type)

    # --- context parallel ----------------------------------------------------------------------
    def local_sequence(self, inputs: torch.Tensor, targets: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """What this rank runs of a micro-batch: under context parallel its zigzag chunks of
        tokens and targets, and the keyword argument with their true positions; else all of it.
        Every rank reads the whole micro-batch (cp peers share samples), so the step's global
        target count needs no cp communication, and each rank's loss sum covers its chunks:
        summed over the world, every token is counted once."""
        if self.context is None:
            return inputs, targets, {}
        return self.context.shard(inputs, targets)

    def context_active(self) -> contextlib.AbstractContextManager:
        return self.context.active() if self.context is not None else contextlib.nullcontext()

    @torch.no_grad()
    def sequence_logits(self, inputs: torch.Tensor, targets: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluation: this rank's outputs and the targets they score (its zigzag chunks under
        context parallel, the whole micro-batch otherwise). A collective like `logits`."""
        if self.context is None:
            return self.logits(inputs), targets
        local, local_targets, extra = self.local_sequence(inputs, targets)
        with self.autocast(), self.context_active():
            if self.pipeline is None:
                out = self.parts[0](local, **extra)
            else:  # the stages add their positions themselves (ContextParallel.stage_positions)
                assert self.ctx.mesh is not None
                out = forward_only(self.parts, self.stage_ids, self.n_stages, self.schedule,
                                   local, self.ctx.mesh["pp"], self.ctx.device)
        if out is None:
            return None, local_targets
        return (out.full_tensor() if isinstance(out, DTensor) else out), local_targets

    @property
    def cp_rank(self) -> int:
        return self.context.cp.rank if self.context is not None else 0

    # --- forward only (evaluation, generation) ---------------------------------------------------
    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Full logits on ranks that hold the last stage (every rank without pipeline); None on
        others. A collective: every rank calls it with the same tokens."""
        with self.autocast():
            if self.pipeline is None:
                out = self.parts[0](tokens)
            else:
                assert self.ctx.mesh is not None  # pipeline parallel (pp > 1) runs on a mesh
                out = forward_only(self.parts, self.stage_ids, self.n_stages, self.schedule,
                                   tokens, self.ctx.mesh["pp"], self.ctx.device)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        return out
