"""Data-parallel communication of one rank per step, before overlap: FSDP's per-unit all-gathers
and reduce-scatters (`CostParams.reduce_every_micro_batch`: every micro-batch, or once after the
last backward; under pipeline parallel ZeRO-2 keeps the stage gathered and gathers once per
step, a per-step term like ZeRO-1's; where the stack runs gradient accumulation around the
pipeline schedule, `CostParams.pipeline_local_batch`, torch's schedule reduce-scatters and
reshards at the end of every call, so both repeat once a call: `DpComm.calls`), HSDP's
all-reduce across replicas, DDP's bucketed all-reduce, Megatron's distributed optimizer
(reduce-scatter of the gradients, all-gather of the low-precision parameters) and shardwise's
ZeRO-1 (all-reduce, then one all-gather per parameter tensor); under expert parallel the routed
experts' gradients and shards on the expert-data-parallel group (the ranks holding the same
experts), the rest on data parallel. How much of it hides behind compute is the cost model's
business (`planner/cost.py`).
Cached: the search predicts many layouts that differ only in micro-batch and recompute."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardwise.planner import comm
from shardwise.planner.bubble import RankLoad
from shardwise.planner.layout import Layout
from shardwise.planner.memory import compute_bytes, rank_params
from shardwise.planner.models import ModelDims
from shardwise.planner.overhead import fsdp_gathers, fsdp_units, param_tensors
from shardwise.planner.params import CostParams
from shardwise.spec.cluster import ClusterSpec


@dataclass(frozen=True)
class DpComm:
    """A rank's data-parallel communication per step, before overlap."""

    gather_per_mb: float  # FSDP's all-gathers, per micro-batch
    early_reduce_per_mb: float  # reduce-scatters run under the next micro-batch's backward
    sync: float  # the reduction after the last backward (of each call)
    param_gather: float  # per step (call): ZeRO-1's gather of the updated shards, ZeRO-2's under PP
    shard_params: float  # parameters the rank's optimizer updates
    time_shard: float
    time_replicate: float
    bytes_shard: float
    bytes_replicate: float
    replicate_axis: bool  # DDP: the reduction runs on dp_replicate
    calls: int = 1  # how often `sync` and `param_gather` run a step: FSDP's, once a pipeline call


def gathers_once_per_step(lo: Layout) -> bool:
    """ZeRO-2 under pipeline parallel keeps the stage's parameters gathered for the whole step:
    its one gather runs with the first micro-batch's forward, unit by unit as Megatron's
    overlapped parameter gather does, not on every micro-batch's path."""
    return lo.zero == 2 and lo.pp > 1


def fsdp_per_micro_batch(lo: Layout, m: int, reduce_every_micro_batch: bool) -> bool:
    """Whether FSDP communicates on every micro-batch's path, where `CostParams.fsdp_overlap`
    says how much hides: its gathers (ZeRO-3, and ZeRO-2 without pipeline parallel), or its
    reduce-scatters before the last backward."""
    if lo.zero < 2 or lo.dp_shard * lo.cp <= 1:
        return False
    return not gathers_once_per_step(lo) or (reduce_every_micro_batch and m > 1)


def dp_comm(model: ModelDims, load: RankLoad, lo: Layout, m: int, precision: str,
            cluster: ClusterSpec, params: CostParams) -> DpComm:
    """What `lo`'s data parallelism communicates on a rank of this `load` (micro-batch and
    recompute do not enter: layouts that differ only in those share the cached entry)."""
    p = params
    return _dp_comm(model, load, lo.zero, lo.dp_shard, lo.dp_replicate, lo.tp, lo.cp, lo.ep,
                    lo.pp, lo.order, m, precision, cluster, p.bandwidth_efficiency,
                    p.collective_latency_s, p.grad_bytes, p.low_precision_params,
                    p.reduce_every_micro_batch, p.state_in_compute_dtype,
                    lo.pipeline_calls(m, p.pipeline_local_batch)[1])


@lru_cache(maxsize=65536)
def _dp_comm(model: ModelDims, load: RankLoad, zero: int, dp_shard: int, dp_replicate: int,
             tp: int, cp: int, ep: int, pp: int, order: str, m: int, precision: str,
             cluster: ClusterSpec, bandwidth_efficiency: float, latency: float, gb: int,
             low_precision_params: bool, reduce_every_micro_batch: bool,
             state_in_compute_dtype: bool, calls: int = 1) -> DpComm:
    lo = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, zero=zero, tp=tp, cp=cp, ep=ep,
                pp=pp, order=order)
    g, _ = comm.mesh_groups(tp, cp, dp_shard, dp_replicate, pp, ep, order, cluster,
                            bandwidth_efficiency, latency)
    nd = lo.dp_shard * lo.cp
    ne = max(1, nd // lo.ep)
    rp = rank_params(model, load, lo.tp, lo.ep)
    dense_p, expert_p = rp.linear + rp.other, rp.experts
    if lo.zero >= 2:
        gather_linear = 2 if precision == "bf16" else 4
        # FSDP gathers what it holds: the non-matmul weights in fp32, or in the compute dtype
        # when the whole model is (`CostParams.state_in_compute_dtype`)
        gather_other = compute_bytes(precision) if state_in_compute_dtype else 4
        gather = gather_linear * rp.linear + gather_other * rp.other
        gathers = fsdp_gathers(lo, m, calls)
        # FSDP gathers (and reduce-scatters) unit by unit: one collective's latency per unit
        units = fsdp_units(model, load, precision)
        lat = (units - 1) * comm.all_gather(1.0, g["shard"])
        t_ag = comm.all_gather(gather, g["shard"]) + comm.all_gather(
            gather_linear * expert_p, g["shard_experts"]) + lat
        t_rs = comm.reduce_scatter(gb * dense_p, g["shard"]) + comm.reduce_scatter(
            gb * expert_p, g["shard_experts"]) + lat
        reductions = m if reduce_every_micro_batch else calls
        t_ar = comm.all_reduce(gb * (dense_p / nd + expert_p / ne), g["replicate"])
        once = gathers_once_per_step(lo)
        return DpComm(
            gather_per_mb=0.0 if once else gathers * t_ag / m,
            early_reduce_per_mb=(reductions - calls) * t_rs / m,
            sync=t_rs + t_ar, param_gather=t_ag if once else 0.0,
            shard_params=dense_p / nd + expert_p / ne,
            time_shard=gathers * t_ag + reductions * t_rs, time_replicate=t_ar * calls,
            bytes_shard=gathers * ((nd - 1) / nd * gather + (ne - 1) / ne * gather_linear
                                   * expert_p)
            + reductions * ((nd - 1) / nd * gb * dense_p + (ne - 1) / ne * gb * expert_p),
            bytes_replicate=2 * (lo.dp_replicate - 1) / lo.dp_replicate * gb * (
                dense_p / nd + expert_p / ne) * calls,
            replicate_axis=False, calls=calls)
    if lo.dp <= 1:
        return DpComm(0.0, 0.0, 0.0, 0.0, dense_p + expert_p, 0.0, 0.0, 0.0, 0.0, False)
    distributed = lo.zero == 1 and low_precision_params
    ddp = lo.zero == 0
    # under expert parallel the routed experts' gradients and shards live on the expert-data-
    # parallel group (the dp ranks that hold the same experts: shard_experts), the rest on dp
    parts = ([(dense_p, g["dp"], lo.dp), (expert_p, g["shard_experts"], ne)]
             if lo.ep > 1 and expert_p else [(dense_p + expert_p, g["dp"], lo.dp)])
    t_red = red_bytes = t_ag = ag_bytes = 0.0
    shard = dense_p + expert_p
    for count, group, n in parts:
        if n <= 1:
            continue
        full = gb * count
        if distributed:  # Megatron's distributed optimizer: reduce-scatter the gradients
            t_red += comm.reduce_scatter(full, group)
            red_bytes += (n - 1) / n * full
        else:
            # DDP's buckets: the first of 1 MiB, then 25 MiB each, one all-reduce apiece
            buckets = 1 + math.ceil(max(full - 2**20, 0.0) / (25 * 2**20))
            t_red += comm.all_reduce(full, group) + (buckets - 1) * comm.all_reduce(1.0, group)
            red_bytes += 2 * (n - 1) / n * full
        if lo.zero == 1:  # the updated shards all-gathered after the step
            width = compute_bytes(precision) if distributed else 4
            t_ag += comm.all_gather(width * count, group)
            ag_bytes += (n - 1) / n * width * count
    if lo.zero == 1:
        if not distributed:  # shardwise's ZeRO-1 gathers one tensor at a time
            t_ag += (param_tensors(model, load) - 1) * comm.all_gather(1.0, g["dp"])
        shard = sum(count / n for count, _, n in parts)
    return DpComm(0.0, 0.0, t_red, t_ag, shard,
                   time_shard=(0.0 if ddp else t_red) + t_ag,
                   time_replicate=t_red if ddp else 0.0,
                   bytes_shard=(0.0 if ddp else red_bytes) + ag_bytes,
                   bytes_replicate=red_bytes if ddp else 0.0, replicate_axis=ddp)
