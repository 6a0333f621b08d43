"""Pipeline parallel with torch.distributed.pipelining.

The model is cut into pp x v stages by block count, as its plan declares (`ModelPlan.blocks`,
`ModelPlan.stages`). Stage s of a model is the full model with the other stages' blocks removed
and the plan's `first` modules set to None on every stage but the first, its `last` modules on
every stage but the last; so parameter names — and therefore checkpoints — are the same at every
pp degree.

Stage placement: `looped` (stage s on rank s mod pp) for GPipe, 1F1B and interleaved 1F1B; `v`
(rank r holds stages r and 2pp-1-r) for the zero-bubble ZBV schedule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from shardwise.models.plan import ModelPlan

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
}


def stage_layer_counts(n_layers: int, n_stages: int, split: Sequence[int] = ()) -> list[int]:
    """Layers per stage: `split` when given (`parallel.pp_layer_split`, checked against the model
    by `checks.check_layout`), else balanced, the remainder to middle stages first, because the
    first stage also runs the embedding and the last the output projection and the loss."""
    if split:
        return list(split)
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = [*range(1, n_stages - 1), 0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def stage_count(pp: int, v: int, schedule: str) -> int:
    """Stages the model is cut into: two per rank for zero-bubble, else `v` per rank."""
    return 2 * pp if schedule == "zero-bubble" else pp * v


def stage_holder(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that holds `stage`: the one placement rule (looped, or V for zero-bubble)."""
    if schedule == "zero-bubble":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stage_ids(pp_rank: int, pp: int, v: int, schedule: str) -> list[int]:
    """The stages `pp_rank` holds, in stage order."""
    return [s for s in range(stage_count(pp, v, schedule))
            if stage_holder(s, pp, schedule) == pp_rank]


def split_model(model: nn.Module, plan: ModelPlan, stage: int, counts: list[int]) -> nn.Module:
    """A copy of `model` holding only stage `stage`'s blocks (and the plan's first / last
    modules on the first / last stage). Blocks are removed from the container's registry, so
    the kept ones keep their names (`layers.5` stays `layers.5`) and iterating a ModuleList or
    the values of a ModuleDict yields the stage's blocks in order."""
    assert plan.stages is not None
    part = copy.deepcopy(model)
    container = part.get_submodule(plan.blocks)
    start = sum(counts[:stage])
    for position, name in enumerate(list(container._modules)):
        if not start <= position < start + counts[stage]:
            del container._modules[name]
    dropped = [*(plan.stages.first if stage != 0 else ()),
               *(plan.stages.last if stage != len(counts) - 1 else ())]
    for path in dropped:
        parent, _, attr = path.rpartition(".")
        setattr(part.get_submodule(parent) if parent else part, attr, None)
    return part


class Pipeline:
    """This rank's stages and the schedule that runs them."""

    def __init__(self, parts: list[nn.Module], ids: list[int], n_stages: int, schedule: str,
                 n_microbatches: int, pp_mesh: DeviceMesh, device: torch.device,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        group = pp_mesh.get_group()
        self.stages = [PipelineStage(part, sid, n_stages, device, group=group)
                       for part, sid in zip(parts, ids, strict=True)]
        self.has_first = 0 in ids
        self.has_last = n_stages - 1 in ids
        cls = SCHEDULES[schedule]
        arg = self.stages[0] if cls in (ScheduleGPipe, Schedule1F1B) else self.stages
        # scale_grads=False: our loss is already normalised by the step's global token count.
        self.schedule = cls(arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)

    def run(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of one step; the per-micro-batch losses on the last stage."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        return losses


# --- forward only (evaluation, generation) ----------------------------------------------------------
def forward_only(parts: list[nn.Module], ids: list[int], n_stages: int, schedule: str,
                 tokens: torch.Tensor, pp_mesh: DeviceMesh, device: torch.device
                 ) -> torch.Tensor | None:
    """Stage by stage with point-to-point sends: no schedule, so any batch size works. The last
    stage's output on the rank that holds it, None on the others (a collective over pp)."""
    group, me, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
    x: torch.Tensor | None = None
    for stage in range(n_stages):
        if stage_holder(stage, pp, schedule) != me:
            continue
        before = stage_holder(stage - 1, pp, schedule) if stage > 0 else me
        if before != me:
            x = _recv_tensor(dist.get_global_rank(group, before), group, device)
        x = parts[ids.index(stage)](tokens if stage == 0 else x)
        after = stage_holder(stage + 1, pp, schedule) if stage < n_stages - 1 else me
        if after != me:
            _send_tensor(x, dist.get_global_rank(group, after), group)
    return x if n_stages - 1 in ids else None


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
