"""`predict(layout, model, cluster, batch, params) -> Prediction`: the one cost-model function.

Every tunable is in the frozen `CostParams`, so that calibration against measured runs is a new
`CostParams`, and every memory term is itemised (`Prediction.memory`) so that each can be compared
with what a run's `model_state` event measures.

Step time, per pipeline rank r and micro-batch (m per step):
    tau_r = compute_r + TP collectives + EP all-to-alls             (on the critical path)
            + exposed(CP ring, PP send/recv, FSDP all-gathers)      (overlapped with compute)
            + framework overhead (CPU; on a GPU: max(tau_r, overhead), see below)
    step  = (m + bubble slots) x max_r tau_r + exposed gradient sync at the end
            (+ ZeRO-1's per-tensor step overhead)
with `comm.exposed(comm, window, overlap)` the part not hidden behind compute. Under pipeline
parallel the gradient reduce-scatter runs after the last backward (torch's pipelining schedules
it there), so it is not overlapped; without it, it overlaps with the last micro-batch's backward.
tokens/s = global tokens / step; MFU = `telemetry.flops` model FLOPs per token x tokens/s /
(devices x dense peak).

`CostParams.efficiency` (default 0.60): the fraction of the dense peak a rank's compute reaches
when it waits for nothing (matmuls, attention and the elementwise work between them). It is
calibrated on one published point, not derived: Meta's Llama 3 405B layout (TP8 CP1 PP16 DP128 on
16,384 H100s, 8K sequences, 16M-token batches, interleaved 1F1B, no activation recompute; "The
Llama 3 Herd of Models" §3.3.2, Table 4: 41 % MFU, band 38-43 %). 0.60 is the round figure that
puts that layout, modelled as Meta ran it with v = 4 (v is not published), inside the band: 39.0 %
(0.65 would give 41.6 %). It is also physically plausible: a large bf16 GEMM reaches about
70-75 % of the H100's dense peak and a block's elementwise kernels pull it lower. The gap:
under shardwise's own memory (fp32 residual stream, eager SwiGLU saving four ffn-wide tensors,
eager RMSNorm and grouped-query attention's repeated K/V: `planner/memory.py`) that layout needs
148 GiB per rank without recompute, so the feasible variant recomputes every block and is
predicted at 31.0 %; and a single efficiency overstates small models (the built-in GPT on this
CPU: predicted 10,240 tokens/s against 6,800-8,500 measured). Measured runs on the target
cluster should replace it: `shardwise plan --calibrate RUN_DIR...` fits `efficiency` and
`overlap` to their step times (`planner/calibrate.py`) and `--write-params` keeps the result.

Framework overhead (`overhead_counts`): time a rank spends in the framework rather than in the
model's FLOPs or in a collective — FSDP2's hooks and all-gather copy-in/out per unit, DTensor's
dispatch per tensor-parallel linear, ZeRO-1's per-tensor sharded step, ring attention's unfused
per-chunk work. It is what the step events' `compute_s_per_rank` (step time less time with a
collective in flight) shows on this machine's CPU runs at equal FLOPs per rank: ddp2 173-182 ms,
zero1-2 251-258, zero2-2 268-275, zero3-2 297-306, tp2 318-347 (benchmarks/RESULTS.md,
"bench_plan 2026-12-02 01:35 UTC"). Each coefficient is a `CostParams` field whose default is
derived from those figures (the field's comment gives the arithmetic) and which `--calibrate`
refits. On a CPU cluster the host is the device, so the overhead adds to the micro-batch's time.
On a GPU the host runs ahead of the stream (kernel launches are asynchronous): a micro-batch takes
`max(device time, host time)`, so the overhead shows only where the kernels it launches are
shorter (small models, tiny micro-batches) and is hidden at GPU scale — Llama 3 405B's
published layout has ~340 ms of kernels per micro-batch and rank against ~90 ms of host work
even at these CPU-measured rates (hidden up to ~3.7 times them), which overstate a GPU server's
host (2 shared cores here): its predicted MFU is unchanged (39.0 %). ZeRO-1's
step is serial with its parameter all-gathers, so it adds to the step on either device.

Memory is itemised in `planner/memory.py`; on a CPU cluster (`cpu-local`) the optimizer's
workspace, the host allocator's share (`cpu_fragmentation`) and the process's own runtime
(`cpu_runtime_overhead_bytes`) replace the CUDA terms — all three measured on this machine's runs
(tests/distributed/test_plan_measured.py), not taken from a GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.planner import comm
from shardwise.planner.bubble import bubble_slots, flights, rank_groups
from shardwise.planner.compute import kind_flops, model_flops_per_token, rank_flops
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import MemoryBreakdown, compute_bytes, rank_memory, rank_params
from shardwise.planner.models import ModelDims, from_shape
from shardwise.spec.cluster import GIB, ClusterSpec


@dataclass(frozen=True)
class CostParams:
    """Every tunable of the cost model, with its default and where that comes from."""

    # Achievable fraction of the dense peak in compute (see the module docstring: calibrated).
    efficiency: float = 0.60
    # Fraction of overlappable communication (FSDP gathers, CP ring, PP p2p, gradient sync) that
    # hides behind compute when there is compute to hide behind.
    overlap: float = 0.8
    # Fraction of line rate NCCL's large-message bus bandwidth reaches (nccl-tests busbw is
    # typically 80-90 % of the link's line rate on NVLink and InfiniBand).
    bandwidth_efficiency: float = 0.85
    # Base latency of one collective: NCCL tuning.cc baseLat for ring/Simple (8.4 µs); the
    # per-step latencies come from the ClusterSpec's links.
    collective_latency_s: float = 8.4e-6
    # Tensor-parallel and expert-parallel collectives sit between dependent matmuls: shardwise does
    # not overlap them (async TP / DualPipe would); 0 = fully exposed.
    tp_overlap: float = 0.0
    ep_overlap: float = 0.0
    # Memory: the caching allocator's reserved-but-unused share of what is allocated.
    fragmentation: float = 0.10
    # CUDA context, cuBLAS/cuDNN workspaces and NCCL's communicator buffers per rank.
    runtime_overhead_bytes: float = 1.0 * GIB
    # Bytes per residual-stream element: shardwise keeps the residual stream and norms in fp32
    # (docs/precision.md); Megatron and Korthikanti et al. keep them in bf16 (2).
    residual_bytes: int = 4
    fused_attention: bool = True  # scaled_dot_product_attention: no s x s score matrix kept
    dropout: bool = False  # the built-in GPT and Llama-style models train without dropout
    # Bytes per logit at the loss: bf16 logits, their fp32 copy, the fp32 log-softmax saved for
    # backward (shardwise computes the loss on fp32 logits).
    logits_bytes: float = 10.0
    # The eager modules' extra saved tensors (RMSNorm's normalised input, GQA's repeated K/V, the
    # output projection's copy of the attention output; `planner/memory.py`): measured on the
    # built-in GPT with saved-tensor hooks. False: the textbook count (Korthikanti et al.).
    eager_activations: bool = True
    # A CPU worker (`cpu-local`): what the process holds before its model exists (Python, torch
    # and its distributed packages, gloo, the data): 320-321 MiB measured per worker on this
    # machine (the memory event's rss_before_model_bytes_per_rank; bench_init: 322 MB); the host
    # allocator's resident share above what torch has allocated, and under ZeRO-1 / FSDP the
    # fp32 copies of the rank's whole model glibc keeps of their per-step transients
    # (`planner/memory.py`; both measured on this machine's runs, tests/distributed/test_plan_measured.py).
    cpu_runtime_overhead_bytes: float = 0.31 * GIB
    cpu_fragmentation: float = 0.05
    cpu_zero1_retained_copies: float = 1.0
    cpu_fsdp_retained_copies: float = 3.6
    # Framework overhead (module docstring; defaults derived from the compute_s_per_rank of the
    # 01:35 UTC bench_plan runs, 2026-12-02, against ddp2's 177.5 ms at the same FLOPs per rank).
    # FSDP2, per unit (`fsdp_units`) per micro-batch: its pre/post forward and backward hooks.
    # With the next field, from zero2-2 (+94 ms: 5 units x 4 micro-batches, 4 gathers) and
    # zero3-2 (+124 ms: 8 gathers): 20 h + 20 g = 94 ms and 20 h + 40 g = 124 ms.
    fsdp_unit_overhead_s: float = 3.2e-3
    # FSDP2, per unit per all-gather: the copy into the flat buffer and out to the parameters.
    fsdp_gather_overhead_s: float = 1.5e-3
    # Tensor parallel, per DTensor-sharded linear (q, k, v, o and the FFN's matrices of every
    # block, recomputed ones again, the embedding and the output layer) per micro-batch, forward
    # and backward: tp2's +155 ms over 8 micro-batches of 30 linears.
    tp_op_overhead_s: float = 0.65e-3
    # ZeRO-1, per parameter tensor per step: a DTensor gradient shard, the AdamW update on
    # DTensors and `full_tensor()` (`parallel/data_parallel.Zero1Optimizer`): zero1-2's +77 ms
    # over 39 tensors.
    zero1_tensor_overhead_s: float = 2.0e-3
    # Context parallel, per block (recomputed ones again) per cp chunk per micro-batch: ring
    # attention's unfused per-chunk attention and merge (benchmarks/RESULTS.md, bench_cp: ~4x
    # the fused SDPA step). From a 5-step cp2 run of the bench_plan model before the 07:17 UTC
    # runs (compute 396-416 ms per rank against ddp2's 177.5 over 8 micro-batches x 4 blocks
    # x 2 chunks): 3.6 ms.
    cp_chunk_overhead_s: float = 3.6e-3


#: the framework-overhead fields of `CostParams` (`overhead_counts`), which `--calibrate` fits
OVERHEAD_FIELDS = ("fsdp_unit_overhead_s", "fsdp_gather_overhead_s", "tp_op_overhead_s",
                   "zero1_tensor_overhead_s", "cp_chunk_overhead_s")

DEFAULT_PARAMS = CostParams()


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    fits: bool
    memory: MemoryBreakdown  # of the rank with the most
    memory_rank: int
    capacity_bytes: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float  # share of the pipeline's time idle
    compute_s: float  # compute per step on the slowest rank, recompute included
    exposed_comm_s: float
    micro_batches: int
    layer_split: tuple[int, ...]
    stage_time_s: tuple[float, ...]  # per pipeline rank, one micro-batch
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per rank per step, by axis
    comm_time_s: dict[str, float] = field(default_factory=dict)  # before overlap
    reason: str = ""
    overhead_s: float = 0.0  # framework overhead exposed per step outside the bubble
    # per step, by OVERHEAD_FIELDS name: how much the step time grows per second of that
    # coefficient (the exposed op counts; 0 where hidden behind a GPU's kernels)
    overhead_counts: dict[str, float] = field(default_factory=dict)

    @property
    def mem_per_rank_bytes(self) -> float:
        return self.memory.total

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self.layout)
        out.update(name=self.layout.name(), available=self.layout.available,
                   micro_batches=self.micro_batches, fits=self.fits,
                   mem_per_rank_bytes=self.memory.total, memory=self.memory.as_dict(),
                   memory_rank=self.memory_rank, capacity_bytes=self.capacity_bytes,
                   step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s, mfu=self.mfu,
                   bubble=self.bubble, compute_s=self.compute_s,
                   exposed_comm_s=self.exposed_comm_s, layer_split=list(self.layer_split),
                   stage_time_s=list(self.stage_time_s), comm_bytes=dict(self.comm_bytes),
                   comm_time_s=dict(self.comm_time_s), reason=self.reason,
                   overhead_s=self.overhead_s, overhead_counts=dict(self.overhead_counts))
        return out


def as_dims(model: Any) -> ModelDims:
    """A ModelDims, or one made from a `ModelShape` (anything with its attributes)."""
    if isinstance(model, ModelDims):
        return model
    return from_shape(model, name=type(model).__name__)


def predict(layout: Layout, model: Any, cluster: ClusterSpec, batch: Batch,
            params: CostParams = DEFAULT_PARAMS) -> Prediction:
    """Memory, step time, tokens/s and MFU of `layout` (assumed valid: `layout.layout_problem`)."""
    model = as_dims(model)
    lo = layout
    m = max(lo.micro_batches(batch), 1)
    s = batch.seq_len
    split, distinct, index = rank_groups(model, lo.pp, lo.v, lo.schedule, s, lo.recompute,
                                         lo.ac_every)
    raw_peak = cluster.peak_flops(batch.precision, batch.tf32)
    peak = raw_peak * params.efficiency
    q = compute_bytes(batch.precision)
    gather_linear = 2 if batch.precision == "bf16" else 4
    eff, base = params.bandwidth_efficiency, params.collective_latency_s
    st = comm.strides(lo.tp, lo.cp, lo.dp_shard, lo.dp_replicate)
    nd = lo.dp_shard * lo.cp
    ne = max(1, nd // lo.ep)
    groups = {
        "tp": comm.cached_group(lo.tp, 1, cluster, eff, base),
        "cp": comm.cached_group(lo.cp, st["cp"], cluster, eff, base),
        "ep": comm.cached_group(lo.ep, st["ep"], cluster, eff, base),
        "shard": comm.cached_group(nd, st["cp"], cluster, eff, base),
        "shard_experts": comm.cached_group(ne, st["ep"] * lo.ep, cluster, eff, base),
        "replicate": comm.cached_group(lo.dp_replicate, st["dp_replicate"], cluster, eff, base),
        "dp": comm.cached_group(lo.dp, st["dp_shard"], cluster, eff, base),
    }
    pp_inter = lo.pp * st["pp"] > cluster.devices_per_node
    tokens_mb = lo.micro_batch * s
    local_tokens = tokens_mb // lo.cp
    sp_div = lo.tp if lo.sequence_parallel else 1
    h = model.hidden
    dense_k, moe_k = kind_flops(model, "dense", s), kind_flops(model, "moe", s)

    # per distinct rank load: (tau, sync, bytes per axis, time per axis, overhead counts per
    # micro-batch, overhead counts per step, what host overhead adds to tau)
    per_load: list[tuple[float, float, dict[str, float], dict[str, float], dict[str, float],
                         dict[str, float], float]] = []
    for load in distinct:
        hw, _ = rank_flops(model, load, s, tokens_mb, lo.tp, lo.cp)
        t_comp = hw / peak
        a_bytes = dict.fromkeys(comm.AXES, 0.0)
        a_time = dict.fromkeys(comm.AXES, 0.0)
        # tensor parallel: 2 all-reduces (or all-gather + reduce-scatter pairs) per block
        # forward, 2 backward, 2 more per recomputed block; 1 for the embedding, 1 for the head.
        if lo.tp > 1 and not model.opaque:
            n = 4 * load.blocks + 2 * (load.ck_dense + load.ck_moe) + load.first + load.last
            size = q * local_tokens * h
            # (sequence parallel: an all-gather + a reduce-scatter in place of each all-reduce)
            one = 2 * comm.all_gather(size, groups["tp"]) if lo.sequence_parallel else \
                comm.all_reduce(size, groups["tp"])
            a_time["tp"] = n * one
            a_bytes["tp"] = n * 2 * (lo.tp - 1) / lo.tp * size
        # context parallel: ring attention passes each rank's K/V chunk around the cp ring:
        # (cp-1) steps forward, twice that backward (K/V and their gradients), again if recomputed.
        cp_exposed = 0.0
        if lo.cp > 1:
            chunk = 2 * q * local_tokens * model.kv * model.hd / lo.tp
            steps = (3 * load.blocks + load.ck_dense + load.ck_moe) * (lo.cp - 1)
            grp = groups["cp"]
            step_t = chunk / grp.bandwidth + grp.alpha_inter if grp.inter else \
                chunk / grp.bandwidth + grp.alpha_intra
            a_time["cp"] = steps * step_t
            a_bytes["cp"] = steps * chunk
            attn = model.layer_flops("dense", s).attention(1, 3, causal_halved=True)
            attn_window = load.blocks * attn * tokens_mb / (lo.tp * lo.cp) / peak
            cp_exposed = comm.exposed(a_time["cp"], attn_window, params.overlap)
        # expert parallel: dispatch + combine all-to-all per MoE block, forward and backward.
        if lo.ep > 1 and load.moe:
            size = q * model.top_k * local_tokens * h / lo.tp
            n = 4 * load.moe + 2 * load.ck_moe
            a_time["ep"] = n * comm.all_to_all(size, groups["ep"])
            a_bytes["ep"] = n * (lo.ep - 1) / lo.ep * size
        # pipeline: each rank sends v activations forward and v gradients back per micro-batch.
        pp_exposed = 0.0
        if lo.pp > 1:
            size = max(q, params.residual_bytes) * local_tokens * h / sp_div
            n = 2 * (2 if lo.schedule == "zero-bubble" else lo.v)
            a_time["pp"] = n * comm.p2p(size, pp_inter, cluster, eff, base)
            a_bytes["pp"] = n * size
            pp_exposed = comm.exposed(a_time["pp"], t_comp, params.overlap)
        # data parallel: FSDP gathers per micro-batch (prefetched under compute), the gradient
        # reduction once per step.
        rp = rank_params(model, load, lo.tp, lo.ep)
        dense_p, expert_p = rp.linear + rp.other, rp.experts
        ag_exposed, sync = 0.0, 0.0
        if lo.zero >= 2:
            gather = gather_linear * rp.linear + 4 * rp.other
            gathers = fsdp_gathers(lo, m)
            # FSDP2 gathers (and reduce-scatters) unit by unit: one collective's latency per
            # unit (the blocks, their norms apart under bf16, and the root), not per rank
            units = fsdp_units(model, load, batch.precision)
            lat = (units - 1) * comm.all_gather(1.0, groups["shard"])
            t_ag = comm.all_gather(gather, groups["shard"]) + comm.all_gather(
                gather_linear * expert_p, groups["shard_experts"]) + lat
            a_time["dp_shard"] += gathers * t_ag
            a_bytes["dp_shard"] += gathers * ((nd - 1) / nd * gather
                                              + (ne - 1) / ne * gather_linear * expert_p)
            ag_exposed = comm.exposed(gathers * t_ag / m, t_comp, params.overlap)
            t_rs = comm.reduce_scatter(4 * dense_p, groups["shard"]) + comm.reduce_scatter(
                4 * expert_p, groups["shard_experts"]) + lat
            t_ar = comm.all_reduce(4 * (dense_p / nd + expert_p / ne), groups["replicate"])
            a_time["dp_shard"] += t_rs
            a_bytes["dp_shard"] += (nd - 1) / nd * 4 * dense_p + (ne - 1) / ne * 4 * expert_p
            a_time["dp_replicate"] += t_ar
            a_bytes["dp_replicate"] += 2 * (lo.dp_replicate - 1) / lo.dp_replicate * 4 * (
                dense_p / nd + expert_p / ne)
            window = 0.0 if lo.pp > 1 else t_comp * 2 / 3
            sync = comm.exposed(t_rs + t_ar, window, params.overlap)
        elif lo.dp > 1:
            full = 4 * (dense_p + expert_p)
            # DDP's buckets: the first of 1 MiB, then 25 MiB each, one all-reduce apiece
            buckets = 1 + math.ceil(max(full - 2**20, 0.0) / (25 * 2**20))
            t_ar = comm.all_reduce(full, groups["dp"]) + (buckets - 1) * comm.all_reduce(
                1.0, groups["dp"])
            axis = "dp_replicate" if lo.zero == 0 else "dp_shard"
            a_time[axis] += t_ar
            a_bytes[axis] += 2 * (lo.dp - 1) / lo.dp * full
            sync = comm.exposed(t_ar, t_comp * 2 / 3, params.overlap)
            if lo.zero == 1:  # the updated shards all-gathered after the step, one per tensor
                t_ag = comm.all_gather(full, groups["shard"]) + (
                    param_tensors(model, load) - 1) * comm.all_gather(1.0, groups["shard"])
                a_time["dp_shard"] += t_ag
                a_bytes["dp_shard"] += (nd - 1) / nd * full
                sync += t_ag
        tau = (t_comp + a_time["tp"] * (1 - params.tp_overlap) + a_time["ep"] * (1 - params.ep_overlap)
               + cp_exposed + pp_exposed + ag_exposed)
        # framework overhead: added on a CPU, overlapped with the kernels on a GPU (docstring)
        per_mb, per_step_n = overhead_counts(lo, model, load, batch, m)
        host = sum(n * getattr(params, k) for k, n in per_mb.items())
        device_tau = tau
        if cluster.cluster.device == "cpu":
            tau += host
        elif host > tau:
            tau = host
        else:
            per_mb = dict.fromkeys(per_mb, 0.0)
        sync += sum(n * getattr(params, k) for k, n in per_step_n.items())
        per_step = {axis: m if axis in ("tp", "cp", "ep", "pp") else 1 for axis in comm.AXES}
        per_load.append((tau, sync, {a: v * per_step[a] for a, v in a_bytes.items()},
                         {a: v * per_step[a] for a, v in a_time.items()}, per_mb, per_step_n,
                         tau - device_tau))
    taus = [per_load[i][0] for i in index]
    syncs = [per_load[i][1] for i in index]
    # memory grows with the micro-batches in flight: per kind of rank, the one holding the most
    worst_mem, worst_rank = _peak_memory(lo, model, batch, distinct, index, m, params,
                                         cluster.cluster.device)
    busiest = max(range(len(distinct)), key=lambda i: sum(per_load[i][2].values()))
    axis_bytes, axis_time = per_load[busiest][2], per_load[busiest][3]


    slowest = max(range(len(taus)), key=taus.__getitem__)
    load = distinct[index[slowest]]
    f = load.dense * dense_k.forward + load.moe * moe_k.forward
    b = (load.dense * dense_k.input_grad + load.moe * moe_k.input_grad
         + load.ck_dense * dense_k.recompute + load.ck_moe * moe_k.recompute)
    w = load.dense * dense_k.weight_grad + load.moe * moe_k.weight_grad
    slots = bubble_slots(lo.schedule, lo.pp, lo.v, f, b, w)
    tau = taus[slowest]
    pipe = (m + slots) * tau
    step = pipe + max(syncs)
    counts_mb = per_load[index[slowest]][4]
    counts_step = per_load[index[max(range(len(syncs)), key=syncs.__getitem__)]][5]
    counts = {k: (m + slots) * counts_mb.get(k, 0.0) + counts_step.get(k, 0.0)
              for k in OVERHEAD_FIELDS}
    overhead = m * per_load[index[slowest]][6] + sum(n * getattr(params, k)
                                                     for k, n in counts_step.items())
    tokens_per_s = batch.tokens / step
    mfu = model_flops_per_token(model, s) * tokens_per_s / (cluster.world * raw_peak)
    hw_slowest, _ = rank_flops(model, load, s, tokens_mb, lo.tp, lo.cp)
    compute = m * hw_slowest / peak
    mem = worst_mem
    fits = mem.total <= cluster.memory_bytes
    reason = "" if fits else (f"needs {mem.total / GIB:.1f} GiB/rank, device has "
                              f"{cluster.memory_bytes / GIB:.1f}")
    return Prediction(layout=lo, fits=fits, memory=mem, memory_rank=worst_rank,
                      capacity_bytes=cluster.memory_bytes, step_time_s=step,
                      tokens_per_s=tokens_per_s, mfu=mfu, bubble=slots * tau / pipe if pipe else 0.0,
                      compute_s=compute,
                      exposed_comm_s=max(step - compute - overhead - slots * tau, 0.0),
                      micro_batches=m, layer_split=tuple(split), stage_time_s=tuple(taus),
                      comm_bytes=axis_bytes, comm_time_s=axis_time, reason=reason,
                      overhead_s=overhead, overhead_counts=counts)


def fsdp_units(model: ModelDims, load: Any, precision: str) -> int:
    """FSDP2 units on a rank: one per block (two under bf16, where the norms are wrapped apart
    to stay fp32: `parallel/data_parallel.apply_fsdp`) and the root."""
    return load.blocks * (2 if precision == "bf16" else 1) + 1


def fsdp_gathers(lo: Layout, m: int) -> int:
    """All-gathers of each FSDP unit per step: ZeRO-2 keeps the parameters from forward to
    backward (one per micro-batch), ZeRO-3 gathers again for backward; under pipeline parallel
    the schedule's hooks gather once per step (ZeRO-2) or once per micro-batch plus one."""
    if lo.pp == 1:
        return m if lo.zero == 2 else 2 * m
    return 1 if lo.zero == 2 else m + 1


def overhead_counts(lo: Layout, model: ModelDims, load: Any, batch: Batch,
                    m: int) -> tuple[dict[str, float], dict[str, float]]:
    """The framework-overhead op counts of one rank (keys: `OVERHEAD_FIELDS`): per micro-batch
    (FSDP units and their gathers, tensor-parallel linears, ring-attention chunks) and per step
    (ZeRO-1's parameter tensors). Times are counts x the `CostParams` coefficients."""
    per_mb: dict[str, float] = {}
    per_step: dict[str, float] = {}
    recomputed = load.blocks + load.ck_dense + load.ck_moe
    if lo.zero >= 2 and lo.dp_shard * lo.cp > 1:
        units = fsdp_units(model, load, batch.precision)
        per_mb["fsdp_unit_overhead_s"] = float(units)
        per_mb["fsdp_gather_overhead_s"] = units * fsdp_gathers(lo, m) / m
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


def predict_memory(layout: Layout, model: Any, batch: Batch,
                   params: CostParams = DEFAULT_PARAMS,
                   device: str = "cuda") -> tuple[MemoryBreakdown, int]:
    """The memory of the rank with the most, and its rank: without any compute or comm
    (`device`: the cluster's, "cuda" or "cpu")."""
    model = as_dims(model)
    lo = layout
    _, distinct, index = rank_groups(model, lo.pp, lo.v, lo.schedule, batch.seq_len, lo.recompute,
                                     lo.ac_every)
    return _peak_memory(lo, model, batch, distinct, index, max(lo.micro_batches(batch), 1), params,
                        device)


def _peak_memory(lo: Layout, model: ModelDims, batch: Batch, distinct: tuple, index: tuple,
                 m: int, params: CostParams, device: str = "cuda") -> tuple[MemoryBreakdown, int]:
    """Memory grows with the micro-batches in flight: per kind of rank, the one holding most."""
    held = flights(lo.schedule, lo.pp, lo.v, m)
    most: dict[int, int] = {}
    for r, i in enumerate(index):
        if i not in most or held[r] > held[most[i]]:
            most[i] = r
    worst: tuple[MemoryBreakdown | None, int] = (None, 0)
    for i, r in most.items():
        mem = rank_memory(lo, model, batch, distinct[i], held[r], params, device)
        if worst[0] is None or mem.total > worst[0].total:
            worst = (mem, r)
    assert worst[0] is not None
    return worst[0], worst[1]
