"""`predict(layout, model, cluster, batch, params) -> Prediction`: the one cost-model function.

Every tunable is in the frozen `CostParams` (`planner/params.py`), so that calibration is a new
`CostParams`, and every memory term is itemised (`Prediction.memory`) and every time term too
(`Prediction.breakdown`, what `shardwise plan --explain` prints).

Step time, per pipeline rank r and micro-batch (m per step):
    tau_r = compute_r (+ recompute)
            + TP collectives + EP all-to-alls        (exposed unless the framework overlaps them)
            + CP K/V passes, PP send/recv, FSDP all-gathers   (overlapped when `overlapped` says)
            + framework overhead (CPU; on a GPU: max(tau_r, host work))
    step  = (m + calls x bubble slots) x max_r tau_r
            + exposed gradient reduction + the per-step parameter all-gather (ZeRO-1's of
              the updated shards; ZeRO-2's under pipeline parallel) + the optimizer step
(calls: 1, or the step's calls of the pipeline schedule where gradient accumulation runs
around it, `CostParams.pipeline_local_batch`; each fills and drains the pipeline, and under
FSDP each ends in torch's REDUCE_GRAD, so the reduction and ZeRO-2's gather come once a call) with
`comm.exposed(comm, window, overlap)` the part not hidden behind compute (TP collectives a
framework overlaps are pipelined chunk by chunk with their GEMMs instead: `comm.pipelined`), and
on a GPU `CostParams.step_host_s` of host work per step on top.
tokens/s = global tokens / step; MFU = `telemetry.flops` model FLOPs per token x tokens/s /
(devices x dense peak).

Compute: on a GPU of a known generation (`[device] generation` in the cluster), op class by op
class (`planner/kernels.py`: GEMMs by shape, attention, memory-bound work, the output layer and
loss, the optimizer step) with the efficiencies `CostParams` holds per generation; they are
fitted on published runs, scored leave-one-source-out (`planner/validate.py`,
benchmarks/RESULTS.md). Elsewhere (this machine's CPU workers, a cluster file without a
generation): FLOPs / (peak x `CostParams.efficiency`), as the CPU calibration measures it.

Framework overhead (`planner/overhead.py`): FSDP2's hooks and copies, DTensor dispatch, ZeRO-1's
per-tensor step, ring attention's per-chunk work, at coefficients measured on this machine's CPU
runs (the `CostParams` fields give the arithmetic). On a CPU the host is the device, so it adds
to each micro-batch; on a GPU the host runs ahead of the stream, so a micro-batch costs
max(kernels, host work), hidden at scale. ZeRO-1's step is serial with its gathers on either.

Memory is itemised in `planner/memory.py`, the fullest rank found in `planner/peak_memory.py`;
the device's kernel-model view (`chip_for`) is `planner/chip.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from shardwise.planner import comm
from shardwise.planner.bubble import (
    RankLoad,
    bubble_slots,
    rank_groups,
)
from shardwise.planner.chip import chip_for
from shardwise.planner.compute import kind_flops, model_flops_per_token, rank_flops
from shardwise.planner.dispatch import token_copies
from shardwise.planner.dpcomm import dp_comm
from shardwise.planner.kernels import (
    ZERO,
    Chip,
    OpTimes,
    block_times,
    embedding_time,
    head_times,
    optimizer_time,
    tp_paired_gemms,
)
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import compute_bytes
from shardwise.planner.models import ModelDims, as_dims
from shardwise.planner.overhead import overhead_counts
from shardwise.planner.params import (
    DEFAULT_PARAMS,
    FITTED_FIELDS,
    OVERHEAD_FIELDS,
    OVERLAPPABLE,
    SAVES_ALL,
    BlockSaves,
    CostParams,
)
from shardwise.planner.peak_memory import memory_key, peak_memory, predict_memory
from shardwise.planner.prediction import COMM_TERMS, TERMS, Prediction
from shardwise.shape import ModelShape
from shardwise.spec.cluster import ClusterSpec

__all__ = ["COMM_TERMS", "DEFAULT_PARAMS", "FITTED_FIELDS", "OVERHEAD_FIELDS", "OVERLAPPABLE",
           "TERMS", "CostParams", "Prediction", "chip_for", "predict", "predict_memory"]

@dataclass(frozen=True)
class _Ctx:
    """What every rank's terms share."""

    lo: Layout
    model: ModelDims
    cluster: ClusterSpec
    batch: Batch
    params: CostParams
    m: int
    chip: Chip | None
    groups: dict[str, comm.Group]
    pp_inter: bool
    calls: int  # calls of the pipeline schedule a step (`Layout.pipeline_calls`)

    @property
    def q(self) -> int:
        return compute_bytes(self.batch.precision)

    @property
    def local_tokens(self) -> int:
        return self.lo.micro_batch * self.batch.seq_len // self.lo.cp

    def overlaps(self, what: str) -> bool:
        return what in self.params.overlapped


@dataclass(frozen=True)
class _RankStep:
    """One kind of pipeline rank: its micro-batch time and its per-step tail."""

    tau: float  # one micro-batch, exposed comm and host work included
    sync_comm: float  # the gradient reduction after the last backward, before overlap
    sync_window: float  # the compute it may hide behind (the pipeline's drain comes on top)
    drain_overlap: bool  # whether the pipeline's drain also hides it
    axis_bytes: dict[str, float]  # per step
    axis_time: dict[str, float]  # per step, before overlap
    counts_mb: dict[str, float]
    counts_step: dict[str, float]
    host_extra: float  # what host work adds to tau
    terms_mb: dict[str, float]  # per micro-batch: compute classes and exposed comm
    terms_step: dict[str, float]  # per step: param_gather (per call), optimizer, overhead
    sync_calls: int = 1  # the reduction and parameter gather repeat once a schedule call

    def sync(self, drain: float, overlap: float) -> dict[str, float]:
        """The per-step tail, given the pipeline's drain (idle time the reduction can use): the
        reduction and the parameter gather once a call of the schedule (`DpComm.calls`)."""
        window = self.sync_window + (drain if self.drain_overlap else 0.0)
        n = self.sync_calls
        return {**self.terms_step, "param_gather": n * self.terms_step.get("param_gather", 0.0),
                "dp_sync": n * comm.exposed(self.sync_comm, window, overlap)}


def _groups(lo: Layout, cluster: ClusterSpec, params: CostParams) -> tuple[dict[str, comm.Group],
                                                                              bool]:
    return comm.mesh_groups(lo.tp, lo.cp, lo.dp_shard, lo.dp_replicate, lo.pp, lo.ep, lo.order,
                            cluster, params.bandwidth_efficiency, params.collective_latency_s)


def predict(layout: Layout, model: ModelDims | ModelShape, cluster: ClusterSpec, batch: Batch,
            params: CostParams = DEFAULT_PARAMS) -> Prediction:
    """Memory, step time, tokens/s and MFU of `layout` (assumed valid: `layout.layout_problem`)."""
    model = as_dims(model)
    lo = layout
    m = max(lo.micro_batches(batch), 1)
    s = batch.seq_len
    split, distinct, index = rank_groups(model, lo.pp, lo.v, lo.schedule, s, lo.recompute,
                                         lo.ac_every, params.pp_split)
    groups, pp_inter = _groups(lo, cluster, params)
    per_call, calls = lo.pipeline_calls(m, params.pipeline_local_batch)
    ctx = _Ctx(lo, model, cluster, batch, params, m, chip_for(cluster, batch, params), groups,
               pp_inter, calls)
    per_load = [_rank_step(ctx, load) for load in distinct]
    taus = [per_load[i].tau for i in index]
    worst_mem, worst_rank = peak_memory(memory_key(lo), model, batch, distinct, index, per_call,
                                         params, cluster.cluster.device, calls)
    busiest = max(range(len(distinct)), key=lambda i: sum(per_load[i].axis_bytes.values()))
    slowest = max(range(len(taus)), key=taus.__getitem__)
    rs = per_load[index[slowest]]
    one_call = _bubble_slots(lo, model, s, distinct[index[slowest]])
    slots = one_call * calls  # every call of the schedule fills and drains the pipeline
    tau = taus[slowest]
    # the drain half of the (last call's) bubble is idle time the gradient reduction can use
    tails = [step.sync(one_call / 2 * tau, params.overlap) for step in per_load]
    syncs = [sum(t.values()) for t in tails]
    tail = max(range(len(syncs)), key=syncs.__getitem__)  # a distinct load, not a rank
    ts = per_load[tail]
    pipe = (m + slots) * tau
    host_step = params.step_host_s if ctx.chip is not None else 0.0
    step = pipe + syncs[tail] + host_step
    counts = {k: (m + slots) * rs.counts_mb.get(k, 0.0) + ts.counts_step.get(k, 0.0)
              for k in OVERHEAD_FIELDS}
    breakdown = {k: m * rs.terms_mb.get(k, 0.0) for k in TERMS}
    breakdown["overhead"] = m * rs.host_extra + tails[tail].get("overhead", 0.0) + host_step
    breakdown["bubble"] = slots * tau
    for k in ("dp_sync", "param_gather", "optimizer"):
        breakdown[k] = tails[tail].get(k, 0.0)
    overhead = breakdown["overhead"]
    tokens_per_s = batch.tokens / step
    raw_peak = cluster.peak_flops(batch.precision, batch.tf32)
    mfu = model_flops_per_token(model, s) * tokens_per_s / (cluster.world * raw_peak)
    compute = sum(breakdown[k] for k in ("gemm", "attention", "memory_bound",
                                         "output_and_loss", "recompute"))
    fits = worst_mem.total <= cluster.memory_bytes
    reason = "" if fits else (f"needs {worst_mem.total / 2**30:.1f} GiB/rank, device has "
                              f"{cluster.memory_bytes / 2**30:.1f}")
    placement = {axis: groups[g].link for axis, g in
                 (("tp", "tp"), ("cp", "cp"), ("ep", "ep"), ("pp", "pp"), ("dp_shard", "shard"),
                  ("dp_replicate", "replicate")) if groups[g].size > 1}
    pod_bound = tuple(axis for axis, g in (("cp", "cp"), ("pp", "pp"), ("dp_shard", "shard"),
                                           ("dp_replicate", "replicate"))
                      if groups[g].pod_bound)
    return Prediction(layout=lo, fits=fits, memory=worst_mem, memory_rank=worst_rank,
                      capacity_bytes=cluster.memory_bytes, step_time_s=step,
                      tokens_per_s=tokens_per_s, mfu=mfu, bubble=slots * tau / pipe if pipe else 0.0,
                      compute_s=compute, exposed_comm_s=sum(breakdown[k] for k in COMM_TERMS),
                      micro_batches=m, layer_split=tuple(split), stage_time_s=tuple(taus),
                      comm_bytes=per_load[busiest].axis_bytes,
                      comm_time_s=per_load[busiest].axis_time, reason=reason,
                      overhead_s=overhead, overhead_counts=counts, breakdown=breakdown,
                      placement=placement, pod_bound=pod_bound)


def _bubble_slots(lo: Layout, model: ModelDims, s: int, load: RankLoad) -> float:
    dense_k, moe_k = kind_flops(model, "dense", s), kind_flops(model, "moe", s)
    f = load.dense * dense_k.forward + load.moe * moe_k.forward
    op = lo.recompute == "op"
    b = (load.dense * dense_k.input_grad + load.moe * moe_k.input_grad
         + load.ck_dense * dense_k.recomputed(op) + load.ck_moe * moe_k.recomputed(op))
    w = load.dense * dense_k.weight_grad + load.moe * moe_k.weight_grad
    return bubble_slots(lo.schedule, lo.pp, lo.v, f, b, w)


def _compute(ctx: _Ctx, load: RankLoad) -> tuple[OpTimes, OpTimes, OpTimes]:
    """(blocks forward + backward, recompute, output layer + loss + embedding) for one
    micro-batch on a rank of this `load`."""
    lo, batch, p = ctx.lo, ctx.batch, ctx.params
    if ctx.chip is None:
        peak = ctx.cluster.peak_flops(batch.precision, batch.tf32) * p.efficiency
        hw, model_flops = rank_flops(ctx.model, load, batch.seq_len, lo.micro_batch *
                                     batch.seq_len, lo.tp, lo.cp, lo.recompute == "op")
        return OpTimes(gemm=model_flops / peak), OpTimes(gemm=(hw - model_flops) / peak), ZERO
    return _kernel_compute(ctx.model, load, lo.micro_batch, batch.seq_len, lo.tp, lo.cp,
                           lo.sequence_parallel, ctx.q, p.residual_bytes, p.fused_attention,
                           p.dropout, p.recompute_whole_block, ctx.chip, lo.ep, p.eager_modules,
                           lo.recompute == "op", BlockSaves.of(p))


@lru_cache(maxsize=16384)
def _kernel_compute(model: ModelDims, load: RankLoad, mb: int, s: int, tp: int, cp: int, sp: bool,
                    q: int, residual: int, fused: bool, dropout: bool, whole: bool,
                    chip: Chip, ep: int = 1, eager: bool = False, op: bool = False,
                    saves: BlockSaves = SAVES_ALL) -> tuple[OpTimes, OpTimes, OpTimes]:
    blocks, recompute, ends = ZERO, ZERO, ZERO
    for kind, count, ck in (("dense", load.dense, load.ck_dense), ("moe", load.moe, load.ck_moe)):
        if not count:
            continue
        bt = block_times(model, kind, mb, s, tp, cp, sp, q, residual, fused, dropout, whole, chip,
                         ep, eager, saves)
        blocks = blocks + (bt.forward + bt.backward).scaled(count)
        recompute = recompute + (bt.op_recompute if op else bt.recompute).scaled(ck)
    if load.last:
        ends = ends + head_times(model, mb, s, tp, cp, q, residual, chip)
    if load.first:
        ends = ends + embedding_time(model, mb, s, cp, q, chip)
    return blocks, recompute, ends


def _rank_step(ctx: _Ctx, load: RankLoad) -> _RankStep:
    lo, model, p, g = ctx.lo, ctx.model, ctx.params, ctx.groups
    q, h, m = ctx.q, model.hidden, ctx.m
    blocks, recompute, ends = _compute(ctx, load)
    t_comp = blocks.total + recompute.total + ends.total
    a_bytes = dict.fromkeys(comm.AXES, 0.0)
    a_time = dict.fromkeys(comm.AXES, 0.0)
    exposed: dict[str, float] = {}
    recomputed = load.ck_dense + load.ck_moe
    op = lo.recompute == "op"
    # tensor parallel: 2 all-reduces (or all-gather + reduce-scatter pairs) per block forward,
    # 2 backward, 2 more per recomputed block; 1 for the embedding, 1 for the head. Per-op
    # recompute runs one again: the saved reduce-scatters leave the two all-gathers (SP), and
    # only the attention's all-reduce precedes the last projection (`op_checkpoint`).
    if lo.tp > 1 and not model.opaque:
        n = 4 * load.blocks + (1 if op else 2) * recomputed + load.first + load.last
        size: float = q * ctx.local_tokens * h
        one = 2 * comm.all_gather(size, g["tp"]) if lo.sequence_parallel else \
            comm.all_reduce(size, g["tp"])
        a_time["tp"] = n * one
        a_bytes["tp"] = n * 2 * (lo.tp - 1) / lo.tp * size
        exposed["tp"] = _overlapped_tp(ctx, load, a_time["tp"], size, blocks, recompute) \
            if ctx.overlaps("tp") else a_time["tp"] * (1 - p.tp_overlap)
    # context parallel: each rank's K/V chunk goes around the cp ring (or is all-gathered): cp-1
    # steps forward, twice that backward (K/V and their gradients), again if recomputed (per-op
    # recompute saves the attention's output and does not run it again).
    if lo.cp > 1:
        chunk = 2 * q * ctx.local_tokens * model.kv * model.hd / lo.tp
        steps = (3 * load.blocks + (0 if op else recomputed)) * (lo.cp - 1)
        grp = g["cp"]
        step_t = chunk / grp.bandwidth + (grp.alpha_inter if grp.inter else grp.alpha_intra)
        a_time["cp"] = steps * step_t
        a_bytes["cp"] = steps * chunk
        window = blocks.attention + recompute.attention if ctx.chip else _attn_window(ctx, load)
        exposed["cp"] = comm.exposed(a_time["cp"], window, p.overlap) if ctx.overlaps("cp") \
            else a_time["cp"]
    # expert parallel: dispatch + combine all-to-all per MoE block, forward and backward.
    if lo.ep > 1 and load.moe:
        token = q * ctx.local_tokens * h / lo.tp
        grp = g["ep"]
        ranks, nodes = token_copies(model.experts, model.top_k, lo.ep, grp.nodes,
                                    p.ep_dispatch, p.ep_routing)
        size, network = ranks * token, nodes * (grp.nodes - 1) / grp.nodes * token
        n_a2a = 4 * load.moe + 2 * load.ck_moe
        a_time["ep"] = n_a2a * comm.all_to_all(size, grp, network)
        a_bytes["ep"] = n_a2a * (lo.ep - 1) / lo.ep * size
        exposed["ep"] = a_time["ep"] * (1 - p.ep_overlap)
    # pipeline: each rank sends v activations forward and v gradients back per micro-batch.
    if lo.pp > 1:
        whole = max(q, p.residual_bytes) * ctx.local_tokens * h
        scatter = p.pp_scatter_gather and lo.tp > 1 and not lo.sequence_parallel
        size = whole / lo.tp if lo.sequence_parallel or scatter else whole
        n_p2p = 2 * (2 if lo.schedule == "zero-bubble" else lo.v)
        # scatter/gather: each rank sends its 1/tp, the receivers all-gather the whole
        gather = comm.all_gather(whole, g["tp"]) if scatter else 0.0
        a_time["pp"] = n_p2p * (comm.p2p_in(size, g["pp"], ctx.pp_inter) + gather)
        a_bytes["pp"] = n_p2p * size
        exposed["pp"] = comm.exposed(a_time["pp"], t_comp, p.overlap) if ctx.overlaps("pp") \
            else a_time["pp"]
    sync_parts, (sync_comm, sync_window, drain, sync_calls) = _data_parallel(
        ctx, load, t_comp, a_time, a_bytes, exposed)
    tau = t_comp + sum(exposed.values())
    # framework overhead: added on a CPU, overlapped with the kernels on a GPU (docstring)
    per_mb, per_step_n = overhead_counts(lo, model, load, ctx.batch, m, ctx.calls)
    host = sum(n * getattr(p, k) for k, n in per_mb.items())
    device_tau = tau
    if ctx.cluster.cluster.device == "cpu":
        tau += host
    elif host > tau:
        tau = host
    else:
        per_mb = dict.fromkeys(per_mb, 0.0)
    sync_parts["overhead"] = sum(n * getattr(p, k) for k, n in per_step_n.items())
    per_step = {axis: m if axis in ("tp", "cp", "ep", "pp") else 1 for axis in comm.AXES}
    terms_mb = {"gemm": blocks.gemm + (ends.gemm if ctx.chip is None else 0.0),
                "attention": blocks.attention, "memory_bound": blocks.memory,
                "output_and_loss": ends.total if ctx.chip is not None else 0.0,
                "recompute": recompute.total, **exposed}
    return _RankStep(tau=tau, sync_comm=sync_comm, sync_window=sync_window, drain_overlap=drain,
                     sync_calls=sync_calls,
                     axis_bytes={a: v * per_step[a] for a, v in a_bytes.items()},
                     axis_time={a: v * per_step[a] for a, v in a_time.items()},
                     counts_mb=per_mb, counts_step=per_step_n, host_extra=tau - device_tau,
                     terms_mb=terms_mb, terms_step=sync_parts)


def _overlapped_tp(ctx: _Ctx, load: RankLoad, total: float, size: float, blocks: OpTimes,
                   recompute: OpTimes) -> float:
    """Exposed tensor-parallel time where the framework overlaps it (`comm.pipelined`): each
    sequence-parallel collective of a dense block split into tp chunks alternating with the
    chunks of the GEMM next to it (`kernels.tp_paired_gemms`), its first chunk exposed and the
    rest hidden only as far as that GEMM lasts: a QKV projection a fifth of the MLP's cannot
    hide an all-gather the MLP could. Elsewhere (MoE or MLA blocks, no sequence parallel, no
    kernel model) every collective is pooled against the blocks' GEMMs together."""
    lo, model, t = ctx.lo, ctx.model, ctx.lo.tp
    if ctx.chip is None or load.moe or model.attn_params or not lo.sequence_parallel:
        return comm.pipelined(total, blocks.gemm + recompute.gemm, t)
    c = comm.all_gather(size, ctx.groups["tp"])  # one all-gather or reduce-scatter

    def paired(gemm: float) -> float:
        return comm.pipelined(c, gemm, t)

    fwd, bwd = tp_paired_gemms(model, lo.micro_batch, ctx.batch.seq_len, t, lo.cp, ctx.q,
                               ctx.chip)
    forward = sum(map(paired, fwd))
    again = paired(fwd[0]) + paired(fwd[2]) if lo.recompute == "op" else forward
    ends = (load.first + load.last) * 2 * c / t  # the embedding's and the head's: first chunks
    return (load.blocks * (forward + sum(map(paired, bwd)))
            + (load.ck_dense + load.ck_moe) * again + ends)


def _attn_window(ctx: _Ctx, load: RankLoad) -> float:
    """Attention time on the FLOP path (the window the CP ring hides behind)."""
    model, s = ctx.model, ctx.batch.seq_len
    peak = ctx.cluster.peak_flops(ctx.batch.precision, ctx.batch.tf32) * ctx.params.efficiency
    attn = model.layer_flops("dense", s).attention(1, 3, causal_halved=True)
    return load.blocks * attn * ctx.lo.micro_batch * s / (ctx.lo.tp * ctx.lo.cp) / peak


def _data_parallel(ctx: _Ctx, load: RankLoad, t_comp: float, a_time: dict[str, float],
                   a_bytes: dict[str, float], exposed: dict[str, float]
                   ) -> tuple[dict[str, float], tuple[float, float, bool, int]]:
    """Data-parallel terms: FSDP's gathers per micro-batch (into `exposed`); the per-step tail
    (ZeRO-1's parameter all-gather, the optimizer step); and the gradient reduction after the
    last backward as (its time, the compute it hides behind, whether the pipeline's drain hides
    it too, how many calls of the schedule a step repeats it and the parameter gather), which
    `predict` resolves once the bubble is known."""
    lo, p = ctx.lo, ctx.params
    dc = dp_comm(ctx.model, load, lo, ctx.m, ctx.batch.precision, ctx.cluster, p)
    a_time["dp_shard"] += dc.time_shard
    a_time["dp_replicate"] += dc.time_replicate
    a_bytes["dp_shard"] += dc.bytes_shard
    a_bytes["dp_replicate"] += dc.bytes_replicate
    if lo.zero >= 2:
        per_mb = dc.gather_per_mb + dc.early_reduce_per_mb
        exposed["dp_fsdp"] = comm.exposed(per_mb, t_comp, p.fsdp_overlap) if ctx.overlaps("dp") \
            else per_mb
    overlapped = ctx.overlaps("dp") and (lo.pp == 1 or ctx.overlaps("dp_under_pp"))
    out = {"param_gather": 0.0, "optimizer": 0.0}
    if dc.param_gather:
        # ZeRO-1's gather of the updated shards, or ZeRO-2's once-per-step gather under PP
        how = "param_gather" if lo.zero == 1 else "dp"
        out["param_gather"] = comm.exposed(dc.param_gather, t_comp / 3, p.overlap) \
            if ctx.overlaps(how) else dc.param_gather
    if ctx.chip is not None:
        out["optimizer"] = optimizer_time(dc.shard_params, p.grad_bytes, p.low_precision_params,
                                          ctx.chip, p.state_in_compute_dtype,
                                          compute_bytes(ctx.batch.precision))
    window = t_comp * 2 / 3 if overlapped else 0.0
    return out, (dc.sync, window, overlapped and lo.pp > 1, dc.calls)
