"""ParallelModel: the model as one rank holds it, and how to run it — the micro-batch loop,
gradient-sync control, the pipeline schedule and its forward-only path (point-to-point sends),
and invariant mode's fixed-order reduction. `parallelize` builds it; the trainer drives it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.models.plan import ModelPlan
from shardwise.parallel.collectives import all_gather_flat
from shardwise.parallel.context import ContextParallel
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.invariant import PairwiseAccumulator, tree_reduce_scatter
from shardwise.parallel.pipeline import Pipeline
from shardwise.parallel.precision import autocast
from shardwise.parallel.tensor_parallel import loss_context, vocab_parallel_loss_sum
from shardwise.parallel.tied import TiedAcrossStages

Batch = tuple[torch.Tensor, torch.Tensor]


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

    def _phase(self, name: str) -> None:
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
        """Run this rank's micro-batches; return its local sum of token losses (float64).

        `loss_scale` multiplies each micro-batch's loss sum before backward (1 / the step's global
        token count, times the fp16 loss scale); every data-parallel reduction is a plain sum.
        Under pipeline parallel the sum is known only on the last stage; other ranks return 0.
        """
        self._loss_scale = loss_scale
        if self.invariant:
            return self._forward_backward_invariant(batches, loss_scale)
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        if self.pipeline is not None:
            inputs = torch.cat([b[0] for b in batches])
            targets = torch.cat([b[1] for b in batches])
            self._phase("forward")
            self._phase("backward")  # the schedule interleaves both; a drill fires before it
            with self._autocast():
                losses = self.pipeline.run(inputs, targets)
            for loss in losses:
                total += loss.detach().double()
            if self.tied is not None:
                self.tied.sum_gradients()
            return total / loss_scale
        model = self.parts[0]
        for i, (full_inputs, full_targets) in enumerate(batches):
            inputs, targets, extra = self.local_sequence(full_inputs, full_targets)
            with _grad_sync(model, enabled=i == len(batches) - 1), \
                    loss_context(self.loss_parallel), self._context_active():
                self._phase("forward")
                with self._autocast():
                    logits = model(inputs, **extra)
                loss_sum = self.token_loss_sum(logits, targets)
                self._phase("backward")
                (loss_sum * loss_scale).backward()
            total += _full_value(loss_sum.detach()).double()
        return total

    def _forward_backward_invariant(self, batches: Sequence[Batch],
                                    loss_scale: float) -> torch.Tensor:
        """Round a = this rank's a-th micro-batch (global micro-batch aD + dp_rank): a fresh
        gradient, tree-reduced over the dp ranks of the round, accumulated pairwise over rounds."""
        model = self.parts[0]
        params = [p for p in model.parameters() if p.requires_grad]
        fsdp = isinstance(model, FSDPModule)
        group = self.ctx.dp_group() if self.ctx.dims.dp > 1 else None
        acc = PairwiseAccumulator()
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for inputs, targets in batches:
            for p in params:
                p.grad = None
            if fsdp:  # FSDP reduces every round with the tree reduce-scatter installed on it
                cast(FSDPModule, model).set_requires_gradient_sync(True)
            self._phase("forward")
            loss_sum = self.token_loss_sum(model(inputs), targets)
            self._phase("backward")
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

    def _autocast(self) -> contextlib.AbstractContextManager:
        """The precision policy's forward context, the same on every layout (parallel/precision)."""
        return autocast(self.precision, self.ctx.device.type)

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

    def _context_active(self) -> contextlib.AbstractContextManager:
        return self.context.active() if self.context is not None else contextlib.nullcontext()

    @torch.no_grad()
    def sequence_logits(self, inputs: torch.Tensor, targets: torch.Tensor
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Evaluation: this rank's outputs and the targets they score (its zigzag chunks under
        context parallel, the whole micro-batch otherwise). A collective like `logits`."""
        if self.context is None:
            return self.logits(inputs), targets
        local, local_targets, extra = self.local_sequence(inputs, targets)
        with self._autocast(), self._context_active():
            out = self.parts[0](local, **extra)
        return (out.full_tensor() if isinstance(out, DTensor) else out), local_targets

    @property
    def cp_rank(self) -> int:
        return self.context.cp.rank if self.context is not None else 0

    # --- forward only (evaluation, generation) ---------------------------------------------------
    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Full logits on ranks that hold the last stage (every rank without pipeline); None on
        others. A collective: every rank calls it with the same tokens."""
        with self._autocast():
            out = self.parts[0](tokens) if self.pipeline is None else self._pipeline_forward(tokens)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        return out

    def _holder(self, stage: int) -> int:
        """pp rank that holds `stage`."""
        pp = self.ctx.dims.pp
        if self.schedule == "zero-bubble":
            return stage if stage < pp else 2 * pp - 1 - stage
        return stage % pp

    def _pipeline_forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Stage by stage with point-to-point sends: no schedule, so any batch size works."""
        assert self.ctx.mesh is not None  # pipeline parallel (pp > 1) runs on a mesh
        pp_mesh = self.ctx.mesh["pp"]
        group, me = pp_mesh.get_group(), pp_mesh.get_local_rank()
        x: torch.Tensor | None = None
        for stage in range(self.n_stages):
            if self._holder(stage) != me:
                continue
            if stage > 0 and self._holder(stage - 1) != me:
                x = _recv_tensor(dist.get_global_rank(group, self._holder(stage - 1)), group,
                                 self.ctx.device)
            x = self.parts[self.stage_ids.index(stage)](tokens if stage == 0 else x)
            if stage < self.n_stages - 1 and self._holder(stage + 1) != me:
                _send_tensor(x, dist.get_global_rank(group, self._holder(stage + 1)), group)
        return x if self.holds_last_stage else None


def _send_tensor(x: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
    """A tensor of any shape and dtype, preceded by its header; everything on x's device (the
    backend may be NCCL, which has no CPU tensors)."""
    x = x.to_local() if isinstance(x, DTensor) else x
    header = torch.tensor([x.dim(), *x.shape, _DTYPES.index(x.dtype)], dtype=torch.int64,
                          device=x.device)
    dist.send(torch.tensor([header.numel()], dtype=torch.int64, device=x.device), dst, group=group)
    dist.send(header, dst, group=group)
    dist.send(x.contiguous(), dst, group=group)


def _recv_tensor(src: int, group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(n, src, group=group)
    header = torch.zeros(int(n), dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    ndim = int(header[0])
    shape, dtype = header[1:1 + ndim].tolist(), _DTYPES[int(header[1 + ndim])]
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src, group=group)
    return x


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


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
