"""Kernel time on a GPU: one rank's compute for one micro-batch, by op class.

FLOPs over one achievable-peak figure treat a 2,048-wide GEMM like a 16,384-wide one and the
norms and activations as free; on an H100 they are not: its 989 TFLOP/s face 3.35 TB/s of HBM,
so elementwise work that is 2 % of a 405B model's step is 15 % of a 1.7B model's. Here each op
class is timed by what bounds it:

- **GEMMs** (every projection, forward, input-gradient and weight-gradient, each with its own
  shape): 2mnk / (peak x e), e = `CostParams` GEMM efficiency of the device's generation x
  k / (k + k_half) (a tile's fixed prologue and epilogue against its k-loop) x the wave
  quantisation of its 128 x 128 output tiles over the SMs (NVIDIA, "Matrix Multiplication
  Background User's Guide": tile and wave quantisation); never faster than reading its operands
  from HBM. An MoE block's routed experts are grouped GEMMs (Megatron-Core's and TE's grouped
  GEMM, one kernel over the rank's experts / ep local experts): each expert sees its own tokens x
  top_k x ep / experts rows, its weight gradient reduces over those rows only, and the groups'
  tiles share the waves. (An earlier version timed them as one GEMM of all the routed rows: one
  weight's gradient, whose output of k x n tiles left most of an H100 idle.)
- **Attention**: fused (FlashAttention-style) kernels skip the masked half of a causal square and
  run forward (2 matmuls) and backward (5) at the generation's attention efficiency (fitted on
  128-wide heads; narrower heads run slower, `head_width_factor`); in a
  sliding-window block they compute the window's keys (`telemetry.flops.attended_keys`) plus half
  a 128-key tile a query, the partial tile at the window's far edge; unfused
  attention runs its score and value matmuls as batched GEMMs over the full square and moves the
  s x s scores through HBM for softmax (and dropout).
- **Memory-bound** work (norms, residual adds, dropout, the MLP activation, the loss's softmax,
  the embedding): bytes / HBM bandwidth, a block's bytes as `planner/elementwise.py` counts them
  for fused kernels or for eager PyTorch modules (`CostParams.eager_modules`). Fused, per block
  and token, forward: each norm reads the
  residual (r bytes an element) and writes its output (q bytes); each residual add reads the
  branch output (q) and the residual (r) and writes the residual (r), plus a one-byte mask under
  dropout; the activation reads its inputs and writes its output (SwiGLU 3 x ffn elements, GeLU
  2 x ffn). An MoE block also permutes its routed tokens, as every token dispatcher does around
  its grouped expert GEMMs (Megatron-Core's `permute` / `unpermute`): each token's top_k copies
  gathered into expert order (read and write top_k x h) and, after the experts, read back,
  weighted by their router probabilities and summed into one (top_k x h read, h written):
  (3 top_k + 1) x h elements a token, the least any dispatcher moves (a second sort by local
  expert after an all-to-all is not counted). Backward reads the output gradient and the saved
  input and writes the input gradient of each: twice the forward's bytes. Without sequence
  parallelism every tensor-parallel rank does the h-wide part in full (redundantly); with it,
  1/tp.
- **Optimizer step**: AdamW reads and writes the fp32 master, both moments, and reads the gradient
  (and writes the low-precision copy when the parameters are held in it), once per step over the
  rank's optimizer shard: bytes / HBM bandwidth.

The efficiencies are `CostParams` fields fitted on published runs (`planner/validate.py`), per
hardware generation; everything else is counted. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from shardwise.planner import op_checkpoint
from shardwise.planner.elementwise import eager_bytes, fused_bytes, module_recompute_bytes
from shardwise.planner.models import ModelDims
from shardwise.planner.params import SAVES_ALL, BlockSaves
from shardwise.telemetry.flops import attended_keys

TILE = 128  # output tile edge of the GEMMs wave quantisation counts
#: head width at which a fused attention kernel's fixed work per score equals its matmuls' (the
#: softmax and its rescaling against the 4·hd FLOPs a score costs): FlashAttention-3's bf16
#: forward on an H100 SXM5 ran 497, 648 and 756 TFLOP/s at head widths 64, 128 and 256 (16K
#: tokens; Shah et al. 2024, Figure 5), which hd / (hd + 56) reproduces within 1.5 %
ATTENTION_HD_HALF = 56.0


@dataclass(frozen=True)
class Chip:
    """What the kernel model reads of one device, efficiencies applied."""

    peak: float  # dense FLOP/s at the run's precision
    gemm: float  # fraction of peak a large GEMM reaches
    attention: float  # fraction of peak the fused attention kernels reach
    k_half: float  # reduction length at which a tile's fixed work equals its k-loop
    sms: int  # 0: no wave quantisation
    hbm: float  # bytes/s; 0: memory-bound work is not timed

    def __hash__(self) -> int:  # hashed by every cached cost term: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            self.__dict__["_hash"] = cached
        return cached


@dataclass(frozen=True)
class OpTimes:
    """Seconds by op class."""

    gemm: float = 0.0
    attention: float = 0.0
    memory: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.memory

    def __add__(self, other: OpTimes) -> OpTimes:
        return OpTimes(self.gemm + other.gemm, self.attention + other.attention,
                       self.memory + other.memory)

    def scaled(self, k: float) -> OpTimes:
        return OpTimes(self.gemm * k, self.attention * k, self.memory * k)


ZERO = OpTimes()


@dataclass(frozen=True)
class BlockTimes:
    """One block, one micro-batch: forward, backward, and the recomputed forward (of a
    checkpointed block; `op_recompute` under per-op checkpointing, `planner/op_checkpoint.py`)."""

    forward: OpTimes
    backward: OpTimes
    recompute: OpTimes
    op_recompute: OpTimes = OpTimes()


def wave_efficiency(m: int, n: int, sms: int, batch: int = 1) -> float:
    """Tile and wave quantisation: the useful share of the output tiles the SMs compute, wave
    by wave (a partial tile at an edge and a partial last wave both idle tensor cores; 1 when
    no SM count is known). A batched GEMM's `batch` problems share the waves."""
    if sms <= 0:
        return 1.0
    tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / sms)
    return (batch * m * n / (TILE * TILE)) / (waves * sms)


@lru_cache(maxsize=65536)
def gemm_time(m: int, n: int, k: int, chip: Chip, operand_bytes: int = 2, batch: int = 1) -> float:
    """One (m x k) @ (k x n) GEMM, or a batched GEMM of `batch` such problems launched as one
    kernel (unfused attention's per-head score and value products: `torch.bmm`), whose tiles
    fill the SMs together rather than one problem's at a time."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    eff = chip.gemm * k / (k + chip.k_half) * wave_efficiency(m, n, chip.sms, batch)
    compute = 2.0 * batch * m * n * k / (chip.peak * eff)
    moved = batch * operand_bytes * (m * k + k * n + m * n) / chip.hbm if chip.hbm else 0.0
    return max(compute, moved)


def linear_times(tokens: int, k: int, n: int, chip: Chip, q: int,
                 groups: int = 1) -> tuple[float, float]:
    """(forward, backward) of one linear layer of a k x n weight over `tokens` rows: backward is
    the input gradient (tokens x n @ n x k) and the weight gradient (k x tokens @ tokens x n).
    `groups` > 1: a grouped GEMM of that many such weights (the local experts), `tokens` rows
    each, launched as one kernel; each weight gradient reduces over its own `tokens` only."""
    fwd = gemm_time(tokens, n, k, chip, q, groups)
    bwd = gemm_time(tokens, k, n, chip, q, groups) + gemm_time(k, n, tokens, chip, q, groups)
    return fwd, bwd


def memory_time(nbytes: float, chip: Chip) -> float:
    return nbytes / chip.hbm if chip.hbm else 0.0


@lru_cache(maxsize=16384)
def block_times(model: ModelDims, kind: str, micro_batch: int, seq_len: int, tp: int, cp: int,
                sp: bool, q: int, residual_bytes: int, fused: bool, dropout: bool,
                whole_block_recompute: bool, chip: Chip, ep: int = 1,
                eager: bool = False, saves: BlockSaves = SAVES_ALL) -> BlockTimes:
    """One block of `kind` ("dense" or "moe", its routed experts spread over `ep` ranks) on one
    rank, for one micro-batch (`eager`: its elementwise work as unfused eager kernels,
    `planner/elementwise.py`; `saves`: what its backward recomputes instead, there too)."""
    tokens = micro_batch * seq_len // cp
    h, a, kv, hd = model.hidden, model.heads, model.kv, model.hd
    r = max(q, residual_bytes)
    # projections: (rows, k, n, groups) per rank, with the tokens each sees; attention whose
    # weights are not GQA's formula (MLA: `ModelDims.attn_params`) as one GEMM of its weights
    # from the hidden size (its FLOPs exact; its low-rank GEMMs' shapes not)
    mats: list[tuple[int, int, int, int]]
    if model.attn_params:
        mats = [(tokens, h, max(model.attn_params // (h * tp), 1), 1)]
    else:
        mats = [(tokens, h, (a + 2 * kv) * hd // tp, 1), (tokens, a * hd // tp, h, 1)]
    if kind == "moe":
        width = model.expert_ffn // tp
        up = width * (2 if model.gated else 1)
        mats += [(tokens, h, model.experts, 1)]  # router
        # the routed experts as grouped GEMMs over the rank's local experts: the ep ranks' top_k
        # copies of their tokens, spread evenly, so each expert's GEMMs see tokens x top_k x ep /
        # experts rows (and its weight gradient reduces over only those)
        local = max(model.experts // ep, 1)
        per_expert = max(tokens * model.top_k * ep // model.experts, 1)
        mats += [(per_expert, h, up, local), (per_expert, width, h, local)]
        shared = tokens * model.shared_experts
        if shared:
            mats += [(shared, h, up, 1), (shared, width, h, 1)]
        ffn_elems = (model.top_k + model.shared_experts) * width
    else:
        width = model.ffn // tp
        mats += [(tokens, h, width * (2 if model.gated else 1), 1), (tokens, width, h, 1)]
        ffn_elems = width
    fwd_g = bwd_g = 0.0
    last_fwd = 0.0
    for n_tok, k, n, groups in mats:
        f, b = linear_times(n_tok, k, n, chip, q, groups)
        fwd_g, bwd_g, last_fwd = fwd_g + f, bwd_g + b, f
    att_f, att_b = _attention(micro_batch, seq_len, tp, cp, a, hd, q, fused, dropout, chip,
                              _kernel_keys(model, seq_len))
    count = eager_bytes if eager else fused_bytes
    fwd_bytes, bwd_bytes = count(model, kind, tokens, tp, sp, q, r, dropout, ffn_elems)
    routed = model.top_k * model.expert_ffn // tp if kind == "moe" else 0
    dense = model.shared_experts * width if kind == "moe" else width
    bwd_bytes += module_recompute_bytes(model, kind, tokens, tp, sp, q, r, saves, routed, dense)
    fwd_m = memory_time(fwd_bytes, chip)
    forward = OpTimes(gemm=fwd_g, memory=fwd_m) + att_f
    backward = OpTimes(gemm=bwd_g, memory=memory_time(bwd_bytes, chip)) + att_b
    recompute = forward if whole_block_recompute else \
        OpTimes(gemm=fwd_g - last_fwd, memory=fwd_m) + att_f
    # per op: the recomputed projections and every elementwise op again, not the attention
    op = OpTimes()
    if kind == "dense" and op_checkpoint.supports_op_checkpoint(model):
        # column-parallel projections split their output, row-parallel ones their input
        again = sum(gemm_time(tokens, k, n // tp, chip, q) if split
                    else gemm_time(tokens, k // tp, n, chip, q)
                    for k, n, split in op_checkpoint.recomputed(model))
        op = OpTimes(gemm=again, memory=fwd_m)
    return BlockTimes(forward, backward, recompute, op)


@lru_cache(maxsize=4096)
def tp_paired_gemms(model: ModelDims, micro_batch: int, seq_len: int, tp: int, cp: int, q: int,
                    chip: Chip) -> tuple[tuple[float, float, float, float],
                                         tuple[float, float, float, float]]:
    """The GEMM next to each sequence-parallel collective of a dense block, which a framework
    that overlaps tensor parallel (Transformer Engine's userbuffers, torch's async TP) splits into
    chunks alternating with that collective's: forward (QKV after its all-gather, O before its
    reduce-scatter, the MLP's up projection after its all-gather, its down projection before
    its reduce-scatter), backward (the input-gradient GEMMs: O's after the gradient's
    all-gather, QKV's before its reduce-scatter, down's, up's)."""
    tokens = micro_batch * seq_len // cp
    h, a, kv, hd = model.hidden, model.heads, model.kv, model.hd
    width = model.ffn // tp
    up = width * (2 if model.gated else 1)
    qkv, o = (a + 2 * kv) * hd // tp, a * hd // tp
    fwd = (gemm_time(tokens, qkv, h, chip, q), gemm_time(tokens, h, o, chip, q),
           gemm_time(tokens, up, h, chip, q), gemm_time(tokens, h, width, chip, q))
    bwd = (gemm_time(tokens, o, h, chip, q), gemm_time(tokens, h, qkv, chip, q),
           gemm_time(tokens, width, h, chip, q), gemm_time(tokens, h, up, chip, q))
    return fwd, bwd


def _kernel_keys(model: ModelDims, seq_len: int) -> float:
    """Keys a fused kernel multiplies a query with, averaged over the blocks: T/2 in a causal
    block (the diagonal tiles' waste is in the fitted attention efficiency), the window's keys
    plus half a tile in a windowed one (its far edge cuts a tile, as the diagonal does)."""
    causal = seq_len / 2
    share = model.window_share
    if not share:
        return causal
    windowed = min(causal, attended_keys(seq_len, model.window) + TILE / 2)
    return (1.0 - share) * causal + share * windowed


def head_width_factor(hd: int) -> float:
    """A fused kernel's throughput at head width `hd` relative to 128, the width the attention
    efficiency is fitted on: hd / (hd + ATTENTION_HD_HALF) over its value at 128, for narrower
    heads only. Wider heads get no credit: FlashAttention-3 runs 256-wide heads 17 % faster, but
    cuDNN (581 against 595 TFLOP/s) and FlashAttention-2 (326 against 370) do not."""
    if hd <= 0 or hd >= 128:
        return 1.0
    return (hd / (hd + ATTENTION_HD_HALF)) / (128 / (128 + ATTENTION_HD_HALF))


def _attention(micro_batch: int, seq_len: int, tp: int, cp: int, heads: int, hd: int, q: int,
               fused: bool, dropout: bool, chip: Chip,
               keys: float | None = None) -> tuple[OpTimes, OpTimes]:
    """(forward, backward) of the attention core of one block on one rank; `keys`: the keys a
    fused kernel multiplies each query with (None: the causal half, T/2). Unfused attention
    multiplies the full square whatever the mask."""
    local_heads = max(heads // tp, 1)
    if fused:
        # causal: each rank's queries see half the keys on average (load-balanced across cp)
        attended = seq_len / 2 if keys is None else keys
        fwd_flops = 4.0 * micro_batch * seq_len * attended * local_heads * hd / cp
        t = fwd_flops / (chip.peak * chip.attention * head_width_factor(hd))
        return OpTimes(attention=t), OpTimes(attention=2.5 * t)
    s = seq_len // cp
    per = micro_batch * local_heads
    # one batched GEMM over the micro-batch's local heads per product (an earlier version
    # quantised each head's s x hd product alone over the SMs: a 16-tile problem on 108 SMs
    # counted at 11 % of peak)
    fwd_g = gemm_time(s, seq_len, hd, chip, q, per) + gemm_time(s, hd, seq_len, chip, q, per)
    bwd_g = 3 * gemm_time(s, hd, seq_len, chip, q, per) + gemm_time(s, seq_len, hd, chip, q, per)
    scores = per * s * seq_len
    drop = 2 * q + 1 if dropout else 0
    fwd_m = memory_time(scores * (2 * q + drop), chip)
    bwd_m = memory_time(scores * (3 * q + drop), chip)
    return OpTimes(attention=fwd_g, memory=fwd_m), OpTimes(attention=bwd_g, memory=bwd_m)


@lru_cache(maxsize=4096)
def head_times(model: ModelDims, micro_batch: int, seq_len: int, tp: int, cp: int, q: int,
               residual_bytes: int, chip: Chip) -> OpTimes:
    """The output layer and the loss on the last stage, forward and backward: the d x V/tp GEMM
    (forward, input and weight gradients), the final norm, and the loss over the vocabulary
    shard as an unfused cross-entropy in fp32 moves it, per logit: the cast to fp32 (read q,
    write 4), the log-softmax (two reads and a write of 4), the gradient of the loss written
    dense (4), the log-softmax's backward (two reads and a write of 4) and the cast back (read
    4, write q): 2q + 36 bytes. (Counting one read and one write of each, 2q + 8, made the loss
    of a 1-2B model with a 50-130K vocabulary a third of what it costs.)"""
    tokens = micro_batch * seq_len // cp
    f, b = linear_times(tokens, model.hidden, model.vocab // tp, chip, q)
    r = max(q, residual_bytes)
    loss_bytes = tokens * (model.vocab // tp) * (2 * q + 36)
    norm_bytes = 3 * tokens * model.hidden * (r + q)
    return OpTimes(gemm=f + b, memory=memory_time(loss_bytes + norm_bytes, chip))


@lru_cache(maxsize=4096)
def embedding_time(model: ModelDims, micro_batch: int, seq_len: int, cp: int, q: int,
                   chip: Chip) -> OpTimes:
    """The embedding lookup and its gradient's scatter-add (fp32) on the first stage."""
    tokens = micro_batch * seq_len // cp
    return OpTimes(memory=memory_time(tokens * model.hidden * (2 * q + 8), chip))


def optimizer_time(params_on_rank: float, grad_bytes: int, low_precision_params: bool,
                   chip: Chip, state_in_compute_dtype: bool = False, q: int = 2) -> float:
    """AdamW over the rank's optimizer shard: master, both moments read and written (24 bytes),
    the gradient read for the norm, the update and its zeroing (3 x grad_bytes), and the
    low-precision parameter copy written (2) when parameters are held in it. With the state in
    the compute dtype (`CostParams.state_in_compute_dtype`, `q` bytes an element) the parameter
    and both moments are read and written in it: 6q."""
    state = 6 * q if state_in_compute_dtype else 24 + (2 if low_precision_params else 0)
    return memory_time(params_on_rank * (state + 3 * grad_bytes), chip)
