"""Per-op selective activation checkpointing (a layout's recompute "op"): what a block keeps and
what its backward runs again.

This is torch's `torch.utils.checkpoint.create_selective_checkpoint_contexts` under torchtitan's
policy (`_save_list` in torchtitan's `models/llama3/parallelize_llama.py`, the default of its
Llama 3 8B train config). Every block is checkpointed. In its forward the outputs of the matmuls,
the attention kernel and the reduce-scatters are saved, except every second matmul; everything
else is recomputed in backward: norms, rotary, SwiGLU's elementwise ops, all-gathers and
all-reduces. Whole-block checkpointing of every `ac_every`-th block ("selective") can recompute as
many GEMM FLOPs, but it keeps every intermediate of the blocks it leaves alone. Under eager
modules those intermediates are most of the memory (module docstring of `planner/memory.py`).

The policy counts matmuls in forward order. It is modelled for blocks with separate projections
in the order q, k, v, o, w1, (w3,) w2: torchtitan's, Hugging Face's and shardwise's built-in
block. Counting from one, the odd ones are saved (q, v, w1, and w2 when gated); the even ones are
recomputed (k, o, and w3 when gated). The last projection's output only enters the residual add,
whose backward needs nothing, so torch's early stop ends the recompute before it, whether or not
it was saved. MoE and MLA blocks are not modelled: `layout_problem` and the reference-set loader
refuse them with `UNSUPPORTED`.
"""

from __future__ import annotations

from functools import lru_cache

from shardwise.planner.models import ModelDims

UNSUPPORTED = ("recompute \"op\" (per-op selective checkpointing) is modelled for dense blocks with "
               "separate q, k, v projections only, not for MoE or latent-attention blocks")


def supports_op_checkpoint(model: ModelDims) -> bool:
    """Dense blocks with separate q, k, v projections: the order the policy is modelled on."""
    return not model.opaque and not model.moe and not model.attn_params


def _projections(model: ModelDims) -> list[tuple[int, int, bool]]:
    """(in, out, output split by tensor parallel) per projection, in forward order."""
    h, a, kv, hd, f = model.hidden, model.heads, model.kv, model.hd, model.ffn
    mats = [(h, a * hd, True), (h, kv * hd, True), (h, kv * hd, True), (a * hd, h, False),
            (h, f, True)]
    if model.gated:
        mats.append((h, f, True))
    mats.append((f, h, False))
    return mats


def _saved(model: ModelDims) -> list[tuple[int, int, bool]]:
    return _projections(model)[0::2]


def recomputed(model: ModelDims) -> list[tuple[int, int, bool]]:
    """The projections backward runs again: the even-numbered ones before the last."""
    return _projections(model)[1:-1:2]


@lru_cache(maxsize=1024)
def recompute_flops_per_token(model: ModelDims) -> float:
    """The recompute's FLOPs per token of one block (whole model, before tensor parallel): its
    recomputed projections. Attention is saved, so it is not run again."""
    return 2.0 * sum(k * n for k, n, _ in recomputed(model))


@lru_cache(maxsize=65536)
def saved_bytes(model: ModelDims, tokens: int, tp: int, sp: bool, q: int, residual_bytes: int,
                eager: bool = True) -> float:
    """Bytes one block keeps for backward for `tokens` tokens on one rank: the checkpoint's
    input (the residual stream; split by sequence parallel), the saved projections' outputs (a
    row-parallel projection's output is the full hidden width before its reduction), the
    attention output with its fp32 log-sum-exp, and under sequence parallel the reduce-scatter
    outputs. Eager torch stores what the policy saves as it runs, needed or not. Compiled
    (`eager` false), the partitioner saves only what backward reads, which drops the block's
    last projection and last reduce-scatter: both only feed the residual add."""
    h = model.hidden
    r = max(q, residual_bytes)
    kept = r * tokens * h / (tp if sp else 1)
    saved = _saved(model)
    if not eager and len(_projections(model)) % 2:  # the last projection is odd-numbered
        saved = saved[:-1]
    outs = sum(n / tp if split else n for _, n, split in saved)
    attention = q * model.heads * model.hd / tp + 4 * model.heads / tp
    scatters = (2 if eager else 1) if sp and tp > 1 else 0
    return kept + tokens * (q * outs + attention + scatters * q * h / tp)
