"""Memory per rank, itemised as the `model_state` event reports it (`shardwise.parallel.accounting`:
param_bytes, gathered_param_bytes, grad_bytes, optimizer_bytes) plus activations, buffers, the
fragmentation allowance and the runtime's own overhead.

Model state, with shardwise's precision policy (docs/precision.md; `parallel/data_parallel.py`):
fp32 parameters, fp32 gradients (accumulated and reduced in fp32) and AdamW's two fp32 moments;
under bf16 FSDP gathers `nn.Linear` weights already cast to bf16 and every other parameter (norms,
embeddings, the root's output head) in fp32; under DDP / ZeRO-1 autocast keeps the bf16 (fp16)
cast of every matmul weight for backward. Per rank, Ψ its parameters after tensor parallel (and
expert parallel for routed experts), N the ZeRO shard group (dp_shard x cp; dp_shard x cp / ep for
experts):

| zero | params | gathered copies                          | grads (peak)             | optimizer |
|------|--------|------------------------------------------|--------------------------|-----------|
| 0    | 4Ψ     | 2Ψ_matmul (autocast, bf16/fp16)          | 4Ψ                       | 8Ψ        |
| 1    | 4Ψ     | 2Ψ_matmul (autocast)                     | 4Ψ                       | 12Ψ/N (*) |
| 2    | 4Ψ/N   | all blocks: 2Ψ_matmul + 4Ψ_other         | 4Ψ/N; 4Ψ if accumulating | 8Ψ/N      |
| 3    | 4Ψ/N   | 2 blocks (current + prefetch) + the root | as ZeRO-2                | 8Ψ/N      |
(*) the fp32 master shard and the two moments.

"With accumulation": shardwise skips gradient sync on all but the last micro-batch
(`parallel/execution.py` `_grad_sync`; torch's pipelining does the same), so FSDP2 accumulates the
unsharded gradients in fp32 until the last backward reduce-scatters them (FSDP that
reduce-scatters every micro-batch, `CostParams.reduce_every_micro_batch`, as PyTorch FSDP does by
default, keeps only the shards). Under pipeline
parallel torch keeps the stage's weights gathered across micro-batches
(`set_reshard_after_backward(False)` until the last), so ZeRO-3 holds what ZeRO-2 holds. Those
unsharded gradients are created by a parameter's first backward (`zero_grad` sets them to None),
so under interleaved 1F1B they do not all meet the activations' peak: backward runs chunk by
chunk, and by the end of the steady phase it has reached only some of the rank's chunks
(`bubble.grad_share_at_peak`; one chunk where a rank runs every forward before its first
backward, as Llama 3 405B's front ranks do at m = pp = 16). The rank holds at its peak either
every activation and those chunks' gradients, or the last chunk's activations and every
gradient, whichever is more. Other schedules count them together. Where the stack runs
gradient accumulation around the pipeline schedule (`CostParams.pipeline_local_batch`: several
calls a step), every call ends in torch's REDUCE_GRAD, which reduce-scatters the stage's
gradients and frees the unsharded ones: a call holds its own unsharded gradients beside the
shards the earlier calls left, never the whole step's.

With `CostParams.low_precision_params` (Megatron's policy, for published runs) ZeRO-0/1 hold the
parameters in the compute dtype (q bytes), the gradients in a main-grad buffer of
`CostParams.grad_bytes` accumulated in place, and the fp32 master with both moments in the
optimizer: q + grad_bytes + 12 bytes a parameter, the 12 divided by N under ZeRO-1 (the
distributed optimizer). With `CostParams.state_in_compute_dtype` (NeMo AutoModel: the whole
model cast to bf16, torch's Adam moments in their parameters' dtype) there is no master at all:
parameters, gathered non-matmul weights and both moments take q bytes an element, and experts
that expert parallel alone spreads (ep = dp·cp: FSDP leaves them out) have no gathered copy.
`grad_bytes` (default 4) sizes every gradient term.

Buffers: DDP runs with `gradient_as_bucket_view=True` (`parallel/data_parallel.py`), so its
communication buckets *are* the gradients and add nothing (an earlier version of this model added
two 25 MB buckets, which a run's measured peak does not show) — except under gradient accumulation:
`zero_grad` sets the gradients to None, so the micro-batches under `no_sync` grow new gradients
beside the buckets DDP keeps (+4Ψ, measured: the torch-allocated peak of DDP at world 2 with 2
micro-batches is one gradient copy above world 4 with one). FSDP2 stages one unit at a time: in
forward its flat all-gather output and the copy of its shard (1 + 1/N of the unit), in backward its
unsharded fp32 gradient on the way into the reduce-scatter (an earlier version counted this only
without accumulation, and no all-gather staging); without accumulation the forward staging and the
gradient shards (created in backward) are never held together. The optimizer step's workspace
(`MemoryBreakdown.workspace`): on a CPU shardwise's AdamW is torch's foreach implementation
(`optimizer.implementation = "auto"`), whose `_foreach_sqrt` of the second moments allocates one
fp32 copy of every parameter the optimizer updates (the rank's shard under ZeRO); fused AdamW on
CUDA needs none. Measured on this machine it is part of the peak: a host process does not give the
activations freed at the end of backward back before the step allocates it.

On a CPU the peak a run reports is the process's resident set, not what torch has allocated, and
glibc's heap keeps freed chunks that later requests of other sizes cannot use. Against torch's own
allocation peak (the profiler's memory events; torch frees the activations before the step's
workspace, so for that comparison take the larger of the two, not their sum) the terms above are
within 5 % for DDP, ZeRO-1 and ZeRO-2/3 at world 2 and 4 on the 6.5 M-parameter GPT of
tests/distributed/test_plan_measured.py (ZeRO-2 at world 4: about +10 %). The resident peak keeps
both, so the model sums them, and is above that by `CostParams.cpu_fragmentation` (5 % of what is
allocated) for DDP, plus under ZeRO-1 one fp32 copy of the rank's whole model
(`cpu_zero1_retained_copies`: the per-parameter all-gathers of the updated shards after the step,
measured +25 MiB at world 2 and 4 for a 24.8 MiB model), and under FSDP about
`cpu_fsdp_retained_copies` (3.6) such copies: the per-unit all-gather outputs and unsharded
parameters, unsharded gradients and reduce-scatter inputs FSDP allocates and frees every step, whose
chunks the activations' sizes do not reuse. Both factors are measured (FSDP: 3.1-4.3 across ZeRO-2/3
at world 2 and 4, the largest rank's; glibc's placement varies by ~10 % between ranks and runs), not
derived, on runs of two steps; the resident peak keeps growing a little after that (ZeRO-3 +15 %
from step 2 to step 12 in benchmarks/bench_plan.py), and tensor- and pipeline-parallel runs keep
25-30 MiB of transients this does not model. On CUDA the caching allocator's `fragmentation` (10 %
of what is allocated) stands in for all of it.

Activations per block and micro-batch — Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4: 34sbh + 5as²b bytes without tensor parallel;
sbh(10 + 24/t + 5as/ht) with tensor parallel; sbh/t(34 + 5as/h) with sequence parallel),
term by term so that it holds for SwiGLU, grouped-query attention, MoE, fp32 residuals and fused
attention (with `CostParams(residual_bytes=2, fused_attention=False, dropout=True,
eager_modules=False)` and a 4h GeLU MLP it is exactly their formula; a test checks it).
x = s·b·h elements, q bytes per compute element, r per residual element:
- not split by tensor parallel (split by sequence parallel): the two norm inputs 2r·x, the two
  norm outputs (attention and MLP inputs) 2q·x, dropout masks 2x;
- split by tensor parallel: Q, K, V (q·x·(a + 2kv)·hd/h); with a fused kernel the attention
  output (also the output projection's input) and the fp32 log-sum-exp — the s² score matrix is
  never stored, which is what Korthikanti et al.'s selective recompute buys; unfused: the
  softmax output (+ dropout mask and output) 5as²b and the output projection's input; the MLP's
  saved tensors (SwiGLU: w1 and w3 outputs, silu(w1 x) and the product: 4 tensors of s·b·ffn;
  GeLU: 2); MoE: those of the top-k + shared experts, the dispatched and combined tokens, the
  router's fp32 logits and probabilities.
With `CostParams.eager_modules` (default true) three tensors the textbook count leaves out are
added, measured with saved-tensor hooks on the built-in GPT (`models/gpt.py`; Hugging Face's Llama
modelling does the same): each RMSNorm's fp32 normalised input before the weight (4·x per norm,
and for the final norm), K and V repeated to the query head count for scaled_dot_product_attention
under grouped-query attention (q·x·2(a − kv)·hd/h), and the contiguous copy of the attention
output that the output projection saves beside the one attention keeps (q·x·a·hd/h). Without
them the model under-predicted the GPT's saved activations by 20-30 %.
What an implementation recomputes or never saves comes off per block (`CostParams` ->
`BlockSaves`): Megatron-Core's module recompute of the norms ("layernorm": their outputs, and the
eager fp32 normalised inputs with them) and of the routed experts' activation ("moe_act": its
output; the first GEMM's output stays, being its input), the same of the dense MLP's and shared
experts' activation (`recompute_act`: a hand-written block backward that saves only the linear
layers' outputs, as LLaMA's; Touvron et al. 2023, §2.4), and the experts' outputs at the combine
where the router's weights scale the activation instead (Megatron-Core's weighted activation,
AutoModel's DeepEP experts). Their forward runs again in backward (`planner/elementwise.py`).
A recomputed block keeps only its input (r·x; ÷t under sequence parallel) and, once, the block
being recomputed; under per-op recompute ("op") every block keeps what the policy saves
(`planner/op_checkpoint.py`) and, once, the rest of the block being recomputed. Context parallel
divides s by cp. The last stage also keeps the final norm's input and output and the logits
(`CostParams.logits_bytes` per element for the micro-batch at the loss, the fp32 log-softmax for
others in flight): for one micro-batch, except under GPipe (all m), because 1F1B, interleaved 1F1B
and ZBV run the last virtual stage's backward straight after its forward (an interleaved last rank
holds many micro-batches of its earlier chunks, one of its last).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from shardwise.planner.bubble import RankLoad
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.models import ModelDims
from shardwise.planner.op_checkpoint import saved_bytes as op_saved_bytes
from shardwise.planner.params import SAVES_ALL, BlockSaves, CostParams


def compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank. `grads` is the peak (unsharded accumulation included); `grads_at_step`
    what the optimizer step sees (the `model_state` event's grad_bytes)."""

    params: float
    gathered_params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    fragmentation: float
    overhead: float
    grads_at_step: float = 0.0
    workspace: float = 0.0  # the optimizer step's temporaries (CPU foreach AdamW, see above)

    @property
    def total(self) -> float:
        return (self.params + self.gathered_params + self.grads + self.optimizer
                + self.activations + self.buffers + self.workspace + self.fragmentation
                + self.overhead)

    @property
    def model_state(self) -> float:
        """Parameters, gradients and optimizer state as the `model_state` event counts them:
        param_bytes + grad_bytes + optimizer_bytes (gathered copies and peaks apart)."""
        return self.params + self.grads_at_step + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class RankParams:
    """Parameters (elements) one rank holds after tensor and expert parallel."""

    linear: float  # matmul weights of its blocks (FSDP gathers them in bf16 under bf16)
    experts: float  # routed-expert weights (split by ep x tp)
    other: float  # norms, router-free non-matmul weights, embedding, output head (gathered fp32)
    block_linear: float  # the largest block's matmul weights (what ZeRO-3 gathers at a time)
    block_other: float
    root: float  # embedding, output head, final norm (FSDP's root unit, kept gathered)

    @property
    def total(self) -> float:
        return self.linear + self.experts + self.other


@lru_cache(maxsize=65536)
def rank_params(model: ModelDims, load: RankLoad, tp: int, ep: int) -> RankParams:
    if model.opaque:
        whole = float(model.params)
        return RankParams(0.0, 0.0, whole, 0.0, 0.0, whole)
    scale = model.param_scale
    linear = experts = other = 0.0
    blk_lin = blk_oth = 0.0
    for kind, count in (("dense", load.dense), ("moe", load.moe)):
        if not count:
            continue
        p = model.layer_params(kind)
        router = model.router_weights if kind == "moe" else 0
        lin = (p["attn"] + p["ffn"]) / tp + router
        exp = p["experts"] / (ep * tp)
        oth = p["replicated"] - router
        linear += count * lin * scale
        experts += count * exp * scale
        other += count * oth * scale
        blk_lin = max(blk_lin, (lin + exp) * scale)
        blk_oth = max(blk_oth, oth * scale)
    root = 0.0
    if load.first:
        root += model.embedding_params / tp
    if load.last:
        root += model.hidden
        if not model.tied or not load.first:  # a tied output on another stage holds a copy
            root += model.vocab * model.hidden / tp
    root *= scale
    return RankParams(linear, experts, other + root, blk_lin, blk_oth, root)


@lru_cache(maxsize=65536)
def layer_activation(model: ModelDims, kind: str, tokens: int, seq_full: int, tp: int, sp: bool,
                     q: int, residual_bytes: int, fused: bool, dropout: bool,
                     eager: bool = False, saves: BlockSaves = SAVES_ALL) -> float:
    """Bytes one block saves for backward for `tokens` tokens (b x s/cp) on one rank (`eager`:
    with the eager implementation's extra tensors; `saves`: what the implementation recomputes
    or never saves; see the module docstring)."""
    h = model.hidden
    x = tokens * h
    r = max(q, residual_bytes)
    norms = (2 * q * x + (2 * 4 * x if eager else 0)) if saves.norms else 0
    rep = 2 * r * x + norms + (2 * x if dropout else 0)
    a, hd, kv = model.heads, model.hd, model.kv
    split = q * tokens * (a + 2 * kv) * hd
    if eager:  # K/V repeated to the query heads; the output projection's copy of its input
        split += q * tokens * (2 * (a - kv) + a) * hd
    if fused:
        split += q * tokens * a * hd + 4 * tokens * a
    else:
        split += (q + (3 if dropout else 0)) * a * tokens * seq_full + q * tokens * a * hd
    # saved MLP tensors: SwiGLU's w1 and w3 outputs and their product (textbook), plus the eager
    # module's silu(w1 x); GeLU's input and output
    mats = (4 if eager else 3) if model.gated else 2
    # recomputed, an activation keeps only its input: the first GEMM's output(s)
    inputs = 2 if model.gated else 1
    dense = mats if saves.act else inputs
    if kind == "moe":
        k = model.top_k
        routed = mats if saves.moe_act else inputs
        combined = 1 if saves.combine else 0
        split += (q * tokens * (routed * k + dense * model.shared_experts) * model.expert_ffn
                  + (1 + combined) * q * k * x + 8 * tokens * model.experts)
    else:
        split += dense * q * tokens * model.ffn
    return (rep + split) / tp if sp else rep + split / tp


def rank_memory(layout: Layout, model: ModelDims, batch: Batch, load: RankLoad,
                inflight: float, params: CostParams, device: str = "cuda",
                grad_share: float = 1.0, calls: int = 1) -> MemoryBreakdown:
    """Peak bytes on one pipeline rank of a `device` ("cuda" or "cpu": the optimizer's
    workspace, the allocator's fragmentation and the runtime's overhead differ). `grad_share`
    < 1: the share of the rank's chunks whose FSDP gradients exist while its activations peak
    (`bubble.grad_share_at_peak`; module docstring). `calls` > 1: the step runs that many calls
    of the pipeline schedule, each ending in a reduce-scatter, so FSDP's unsharded gradients
    accumulate over one call beside the shards the earlier calls left."""
    lo = layout
    q = compute_bytes(batch.precision)
    gather_linear = 2 if batch.precision == "bf16" else 4
    cast_copy = 2 if batch.precision in ("bf16", "fp16") else 0  # autocast's saved weight casts
    rp = rank_params(model, load, lo.tp, lo.ep)
    nd = lo.dp_shard * lo.cp
    ne = max(1, nd // lo.ep)
    full = rp.total
    shard = (rp.linear + rp.other) / nd + rp.experts / ne
    accumulate = lo.micro_batches(batch) > 1
    buffers = 0.0
    g_bytes = params.grad_bytes
    low = params.state_in_compute_dtype  # no fp32 master, moments in the compute dtype
    held_shards = 0.0
    moments = 2 * q if low else 8
    if lo.zero <= 1 and (params.low_precision_params or low):
        # Megatron: parameters in the compute dtype, gradients in a contiguous main-grad buffer
        # (accumulated in place), fp32 master + both moments in the (distributed) optimizer;
        # with the state in the compute dtype, no master and low-precision moments
        p_bytes = q * full
        gathered = 0.0
        grads = grads_step = g_bytes * full
        opt = (moments if low else 12) * (full if lo.zero == 0 else shard)
        optimized = full if lo.zero == 0 else shard
    elif lo.zero <= 1:
        p_bytes = 4 * full
        gathered = cast_copy * (rp.linear + rp.experts)
        grads = grads_step = g_bytes * full
        opt = 8 * full if lo.zero == 0 else 12 * shard
        optimized = full if lo.zero == 0 else shard  # what AdamW updates on this rank
        if (lo.tp > 1 or lo.pp > 1) and lo.dp * lo.cp > 1:
            # parallel/flat_dp (DDP cannot wrap tp/pp): the gradients packed into one flat
            # buffer (the all-reduce or reduce-scatter input, reused for the all-gather), and
            # under ZeRO-1 the slice of summed gradients received
            buffers += g_bytes * full + (g_bytes * full / lo.dp_shard if lo.zero == 1 else 0)
        elif lo.dp > 1 and accumulate:  # no_sync: gradients grow beside DDP's (kept) buckets
            buffers += g_bytes * full
    else:
        p_bytes = (q if low else 4) * shard
        # experts that expert parallel alone spreads (ne = 1) are not FSDP's: used where they are
        # held, with no gathered copy when that is already in the compute dtype
        experts = 0.0 if low and ne == 1 else rp.experts
        if lo.zero == 2 or lo.pp > 1 or load.blocks <= 2:
            lin, oth = rp.linear + experts, rp.other
        else:
            # the two largest blocks (never more than all of them: one MoE block can outweigh
            # every dense block together) and the root
            lin = min(2 * rp.block_linear, rp.linear + experts)
            oth = min(2 * rp.block_other + rp.root, rp.other)
        gathered = gather_linear * lin + (q if low else 4) * oth \
            + (2 * lin if batch.precision == "fp16" else 0)
        grads_step = g_bytes * shard
        # shardwise skips the reduction until the last micro-batch (unsharded accumulation);
        # FSDP that reduce-scatters every micro-batch accumulates the shards
        grads = g_bytes * full if accumulate and not params.reduce_every_micro_batch \
            else grads_step
        if calls > 1 and grads > grads_step:
            held_shards = grads_step  # reduced by the earlier calls, beside this call's
        opt = moments * shard
        optimized = shard
        # one unit's staging at a time: in forward its flat all-gather output and input copy,
        # in backward its unsharded fp32 gradient on the way into the reduce-scatter. Without
        # accumulation no gradient exists in forward (zero_grad sets them to None), so the
        # forward staging competes with the gradient shards, not with them added.
        unit_gather = (gather_linear * rp.block_linear + (q if low else 4) * rp.block_other) \
            * (1 + 1 / nd)
        unit_reduce = 4 * (rp.block_linear + rp.block_other)
        unsharded = accumulate and not params.reduce_every_micro_batch
        buffers += max(unit_gather - (0 if unsharded else grads), unit_reduce)

    acts = 0.0
    if not model.opaque:
        tokens = lo.micro_batch * (batch.seq_len // lo.cp)
        sp = lo.sequence_parallel
        res = params.residual_bytes

        def block(kind: str) -> float:
            return layer_activation(model, kind, tokens, batch.seq_len, lo.tp, sp, q, res,
                                    params.fused_attention, params.dropout,
                                    params.eager_modules, BlockSaves.of(params))

        kept = max(q, res) * tokens * model.hidden / (lo.tp if sp else 1)
        a_dense = block("dense") if load.dense else 0.0
        a_moe = block("moe") if load.moe else 0.0
        working = max(a_dense if load.ck_dense else 0.0, a_moe if load.ck_moe else 0.0)
        if lo.recompute == "op":
            # per op: what the policy saves; a block's backward recomputes the rest of it
            kept = op_saved_bytes(model, tokens, lo.tp, sp, q, res, params.eager_modules)
            working = max(working - kept, 0.0)
        per_mb = ((load.dense - load.ck_dense) * a_dense + (load.moe - load.ck_moe) * a_moe
                  + (load.ck_dense + load.ck_moe) * kept)
        acts = inflight * per_mb + working
        if load.last:
            # the head's tensors live from its forward to its backward: under 1F1B, interleaved
            # and ZBV the last virtual stage runs each micro-batch's backward straight after its
            # forward, so one micro-batch holds them however many the rank's earlier chunks hold
            head_held = inflight if lo.schedule == "gpipe" else min(inflight, 1.0)
            x = tokens * model.hidden / (lo.tp if sp else 1)
            logits = tokens * model.vocab / lo.tp
            acts += head_held * (max(q, res) + q + (4 if params.eager_modules else 0)) * x
            acts += params.logits_bytes * logits + 4 * logits * max(head_held - 1, 0)
        if lo.tp > 1:  # the gathered block input of sequence / tensor parallel
            buffers += q * tokens * model.hidden
        if lo.ep > 1:  # all-to-all send and receive buffers of the dispatched tokens
            buffers += 2 * q * model.top_k * tokens * model.hidden / (lo.tp if sp else 1)
        if lo.cp > 1:  # ring attention's K/V blocks in flight (send + receive)
            buffers += 2 * 2 * q * tokens * model.kv * model.hd / lo.tp
    if grad_share < 1 and lo.zero >= 2 and grads > grads_step:
        # FSDP's unsharded gradients appear chunk by chunk as backward frees activations: the
        # peak is at one end, the activations' peak with the chunks' gradients backward has
        # reached by then, or all the gradients with the last chunk's activations
        if acts + grad_share * grads >= acts / lo.v + grads:
            grads *= grad_share
        else:
            acts /= lo.v
    grads += held_shards
    cpu = device == "cpu"
    workspace = 4 * optimized if cpu else 0.0  # foreach AdamW's sqrt of the second moments
    allocated = p_bytes + gathered + grads + opt + acts + buffers + workspace
    frag = (params.cpu_fragmentation if cpu else params.fragmentation) * allocated
    if cpu and lo.zero >= 1:  # glibc keeps ZeRO's per-step transients (see the module docstring)
        copies = params.cpu_zero1_retained_copies if lo.zero == 1 else params.cpu_fsdp_retained_copies
        frag += copies * 4 * full
    return MemoryBreakdown(params=p_bytes, gathered_params=gathered, grads=grads, optimizer=opt,
                           activations=acts, buffers=buffers, fragmentation=frag,
                           overhead=params.cpu_runtime_overhead_bytes if cpu
                           else params.runtime_overhead_bytes,
                           grads_at_step=grads_step, workspace=workspace)


def state_lower_bound(model: ModelDims, layout: Layout, batch: Batch,
                      params: CostParams) -> float:
    """Bytes of parameters + optimizer state per rank that no schedule, micro-batch or recompute
    choice can avoid (an even pipeline split, no gathered copies) under `params`' precision
    policy: for early pruning."""
    total = model.params
    experts = 0.0
    if not model.opaque and model.moe:
        experts = sum(model.layer_params(k)["experts"] for k in model.layer_kinds) * model.param_scale
    tp = layout.tp
    dense = (total - experts) / tp / layout.pp
    exp = experts / (layout.ep * tp) / layout.pp
    nd = layout.dp_shard * layout.cp
    ne = max(1, nd // layout.ep)
    # the least of every precision policy: parameters in the compute dtype, gradients of
    # `grad_bytes`, moments in the compute dtype where the stack says so
    q, g = compute_bytes(batch.precision), params.grad_bytes
    low = params.state_in_compute_dtype
    keep = q if (low or params.low_precision_params) else 4
    moments = 2 * q if low else 8
    if layout.zero <= 1:
        opt = moments if layout.zero == 0 else (moments if low else 12) / nd
        return (keep + g) * (dense + exp) + opt * (dense + exp)
    grads = g * (dense + exp) if layout.micro_batches(batch) > 1 else g * (dense / nd + exp / ne)
    return (keep + moments) * (dense / nd + exp / ne) + grads
