"""Framework overhead: the op counts of the time a rank spends in the framework rather than in the
model's FLOPs or in a collective (FSDP2's hooks and all-gather copy-in/out per unit, DTensor's
dispatch per tensor-parallel linear, ZeRO-1's per-tensor sharded step, ring attention's unfused
per-chunk work). The time is each count x its `CostParams` coefficient (`OVERHEAD_FIELDS`); the
coefficients are measured on shardwise's own runs (see `planner/params.py`)."""

from __future__ import annotations

from typing import Any

from shardwise.planner.layout import Batch, Layout
from shardwise.planner.models import ModelDims


def fsdp_units(model: ModelDims, load: Any, precision: str) -> int:
    """FSDP2 units on a rank: one per block (two under bf16, where the norms are wrapped apart
    to stay fp32: `parallel/data_parallel.apply_fsdp`) and the root."""
    return load.blocks * (2 if precision == "bf16" else 1) + 1


def fsdp_gathers(lo: Layout, m: int, calls: int = 1) -> int:
    """All-gathers of each FSDP unit per step: ZeRO-2 keeps the parameters from forward to
    backward (one per micro-batch), ZeRO-3 gathers again for backward; under pipeline parallel
    the schedule's hooks gather once per call of the schedule (ZeRO-2: torch's REDUCE_GRAD
    reshards at the end of each of the step's `calls`) or once per micro-batch plus once a
    call."""
    if lo.pp == 1:
        return m if lo.zero == 2 else 2 * m
    return calls if lo.zero == 2 else m + calls


def overhead_counts(lo: Layout, model: ModelDims, load: Any, batch: Batch,
                    m: int, calls: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """The framework-overhead op counts of one rank (keys: `OVERHEAD_FIELDS`): per micro-batch
    (FSDP units and their gathers, tensor-parallel linears, ring-attention chunks) and per step
    (ZeRO-1's parameter tensors). Times are counts x the `CostParams` coefficients."""
    per_mb: dict[str, float] = {}
    per_step: dict[str, float] = {}
    recomputed = load.blocks + load.ck_dense + load.ck_moe
    if lo.zero >= 2 and lo.dp_shard * lo.cp > 1:
        units = fsdp_units(model, load, batch.precision)
        per_mb["fsdp_unit_overhead_s"] = float(units)
        per_mb["fsdp_gather_overhead_s"] = units * fsdp_gathers(lo, m, calls) / m
    elif lo.zero == 1 and lo.dp > 1:
        per_step["zero1_tensor_overhead_s"] = float(param_tensors(model, load))
    if lo.tp > 1 and not model.opaque:
        per_block = 4 + (3 if model.gated else 2)
        per_mb["tp_op_overhead_s"] = float(per_block * recomputed + load.first + load.last)
    if lo.cp > 1:
        per_mb["cp_chunk_overhead_s"] = float(recomputed * lo.cp)
    return per_mb, per_step


def param_tensors(model: ModelDims, load: Any) -> int:
    """Parameter tensors on a rank (what ZeRO-1 all-gathers one by one after its step): per block
    the q, k, v, o projections, the FFN's two or three matrices (MoE: each expert's, the shared
    experts' and the router) and two norms; the embedding, final norm and untied output."""
    if model.opaque:
        return 1
    mats = 3 if model.gated else 2
    moe_block = 4 + mats * (model.experts + model.shared_experts) + 1 + 2
    count = load.dense * (4 + mats + 2) + load.moe * moe_block
    if load.first:
        count += 1
    if load.last:
        count += 1 + (0 if model.tied and load.first else 1)
    return max(count, 1)
