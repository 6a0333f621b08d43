"""Pipeline parallel with torch.distributed.pipelining.

The model is cut into pp x v stages by layer count. Stage s of a model is the full model with the
other stages' layers removed (first stage keeps the embedding, last keeps the final norm and
output), so parameter names — and therefore checkpoints — are the same at every pp degree.

Stage placement: `looped` (stage s on rank s mod pp) for GPipe, 1F1B and interleaved 1F1B; `v`
(rank r holds stages r and 2pp-1-r) for the zero-bubble ZBV schedule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
}


def stage_layer_counts(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, balanced; the remainder goes to middle stages first, because the first
    stage also runs the embedding and the last the output projection and the loss."""
    base, extra = divmod(n_layers, n_stages)
    counts = [base] * n_stages
    order = [*range(1, n_stages - 1), 0, n_stages - 1] if n_stages > 2 else list(range(n_stages))
    for s in order[:extra]:
        counts[s] += 1
    return counts


def stage_ids(pp_rank: int, pp: int, v: int, schedule: str) -> list[int]:
    if schedule == "zero-bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(v)]


def split_model(model: nn.Module, stage: int, counts: list[int]) -> nn.Module:
    """A copy of `model` holding only stage `stage`'s layers (and embedding / head if first/last)."""
    part = copy.deepcopy(model)
    start = sum(counts[:stage])
    keep = {str(i) for i in range(start, start + counts[stage])}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != len(counts) - 1:
        part.norm = None
        part.output = None
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
