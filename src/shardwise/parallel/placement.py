"""Where a layout puts every parameter of a model, worked out from the plan alone (no process
group, the model built on the meta device): what `shardwise train --print-placement` shows before any
worker starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from shardwise.models.plan import ModelPlan
from shardwise.parallel.dims import ParallelDims
from shardwise.parallel.pipeline import stage_ids, stage_layer_counts

_TP_DIM = {"colwise": 0, "output": 0, "embedding": 0, "rowwise": 1}


@dataclass(frozen=True)
class ParamPlacement:
    name: str
    shape: tuple[int, ...]
    stages: tuple[int, ...]  # pipeline stages that hold it (every stage: (0,) without pp)
    tp: str  # "Shard(d)" or "Replicate" over tp ("-" without tp)
    dp: str  # how the data-parallel axes hold it
    local_shape: tuple[int, ...]


def stage_map(plan: ModelPlan, dims: ParallelDims, virtual: int, schedule: str,
              split: tuple[int, ...] = ()) -> list[dict]:
    """For every pipeline stage: its pp rank, its blocks, and the first/last modules it runs."""
    if dims.pp == 1:
        return [{"stage": 0, "pp_rank": 0, "blocks": (0, plan.n_blocks), "extra": []}]
    n_stages = dims.pp * virtual
    counts = stage_layer_counts(plan.n_blocks, n_stages, split)
    holder = {s: r for r in range(dims.pp) for s in stage_ids(r, dims.pp, virtual, schedule)}
    out = []
    for s in range(n_stages):
        start = sum(counts[:s])
        extra = [*(plan.stages.first if s == 0 else ()),
                 *(plan.stages.last if s == n_stages - 1 else ())] if plan.stages else []
        out.append({"stage": s, "pp_rank": holder[s], "blocks": (start, start + counts[s]),
                    "extra": extra})
    return out


def placements(model: nn.Module, plan: ModelPlan, dims: ParallelDims, virtual: int,
               schedule: str, split: tuple[int, ...] = ()) -> list[ParamPlacement]:
    stages = stage_map(plan, dims, virtual, schedule, split)
    tp_of = {name: style for name, (style, _size) in plan.tp_sizes.items()}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        module_name = name.rpartition(".")[0]
        holding = tuple(st["stage"] for st in stages if _on_stage(name, plan, st))
        style = tp_of.get(module_name)
        local = list(p.shape)
        tp = "-"
        if dims.tp > 1:
            dim = _TP_DIM.get(style or "")
            if dim is not None and name.endswith(".bias") and style == "rowwise":
                dim = None  # a row-parallel bias is added once, to the reduced sum
            if dim is not None and dim < p.dim():
                tp = f"Shard({dim})"
                local[dim] = math.ceil(local[dim] / dims.tp)
            else:
                tp = "Replicate"
        if dims.zero >= 2 and dims.dp_shard > 1:
            dp = f"Shard(0) over dp_shard={dims.dp_shard}"
            if dims.dp_replicate > 1:
                dp += f", replicated over dp_replicate={dims.dp_replicate}"
            local[0] = math.ceil(local[0] / dims.dp_shard)
        elif dims.dp > 1:
            dp = f"replicated over dp={dims.dp}" + (
                " (optimizer state Shard(0))" if dims.zero == 1 else "")
        else:
            dp = "-"
        out.append(ParamPlacement(name, tuple(p.shape), holding, tp, dp, tuple(local)))
    return out


def _on_stage(name: str, plan: ModelPlan, stage: dict) -> bool:
    if plan.blocks and name.startswith(plan.blocks + "."):
        index = name[len(plan.blocks) + 1:].split(".", 1)[0]
        position = int(index) if index.isdigit() else 0
        return stage["blocks"][0] <= position < stage["blocks"][1]
    if plan.stages is None:
        return True
    owned = [*plan.stages.first, *plan.stages.last]
    for path in owned:
        if name.startswith(path + "."):
            return path in stage["extra"]
    return True  # neither a block nor a first/last module: every stage holds it


def fsdp_units(plan: ModelPlan, dims: ParallelDims) -> list[str]:
    if dims.zero < 2:
        return []
    units = [f"{plan.blocks}.{i}" for i in range(plan.n_blocks)] if plan.blocks else []
    return [*units, "(root: everything else)"]


def tp_share(model: nn.Module, plan: ModelPlan) -> float:
    """Share of the blocks' parameters that tensor parallel shards (colwise/rowwise weights)."""
    if not plan.blocks:
        return 0.0
    total = sharded = 0
    tp_of = {name: style for name, (style, _size) in plan.tp_sizes.items()}
    for name, p in model.named_parameters():
        if not name.startswith(plan.blocks + "."):
            continue
        total += p.numel()
        style = tp_of.get(name.rpartition(".")[0])
        if style in ("colwise", "rowwise") and not (style == "rowwise" and name.endswith("bias")):
            sharded += p.numel()
    return sharded / total if total else 0.0


def render(model: nn.Module, plan: ModelPlan, dims: ParallelDims, virtual: int,
           schedule: str, split: tuple[int, ...] = ()) -> str:
    lines = [f"layout: {dims.describe()}",
             f"model: {plan.shape.params:,} parameters, {plan.n_blocks} blocks"
             f"{' (' + plan.blocks + ')' if plan.blocks else ''}; tensor-parallel plan: "
             f"{'yes' if plan.supports_tp else 'no'}; pipeline plan: "
             f"{'yes' if plan.supports_pp else 'no'}"]
    if dims.pp > 1:
        lines.append("pipeline stages:")
        for st in stage_map(plan, dims, virtual, schedule, split):
            a, b = st["blocks"]
            extra = f" + {', '.join(st['extra'])}" if st["extra"] else ""
            lines.append(f"  stage {st['stage']} on pp rank {st['pp_rank']}: blocks {a}..{b - 1}"
                         f"{extra}")
    units = fsdp_units(plan, dims)
    if units:
        lines.append(f"FSDP units ({len(units)}): " + ", ".join(units))
    if plan.tied:
        lines.append("tied groups (one tensor each): "
                     + "; ".join(" = ".join(g) for g in plan.tied))
    if dims.tp > 1:
        lines.append(f"share of block parameters sharded by tp: {tp_share(model, plan):.1%}")
    rows = placements(model, plan, dims, virtual, schedule, split)
    width = max(len(r.name) for r in rows) if rows else 10
    lines.append(f"{'parameter':<{width}}  {'shape':<14} {'stages':<8} {'tp':<10} "
                 f"{'local shape':<14} data parallel")
    for r in rows:
        stages = ",".join(map(str, r.stages)) if dims.pp > 1 else "-"
        lines.append(f"{r.name:<{width}}  {_shape(r.shape):<14} {stages:<8} {r.tp:<10} "
                     f"{_shape(r.local_shape):<14} {r.dp}")
    return "\n".join(lines) + "\n"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"
