"""Bytes a block's memory-bound work moves through HBM per token, forward and backward.

Two implementations of the same block are counted:

- **fused** (Megatron-Core and Transformer Engine's fused kernels, torch.compile's generated ones,
  a framework whose norm and activation are one aten kernel each): each norm reads the residual
  (r bytes an element) and writes its output (q bytes); each residual add reads the branch
  output (q) and the residual (r) and writes the residual (r), plus a one-byte mask under
  dropout; the activation reads its inputs and writes its output (SwiGLU 3 x ffn elements, GeLU
  2 x ffn). Backward reads the output gradient and the saved input and writes the input
  gradient of each: twice the forward's bytes. The least the block can move.
- **eager** (`CostParams.eager_modules`: PyTorch modules written like the built-in block,
  `models/gpt.py`, as Meta's reference Llama, Hugging Face's and torchtitan's are: RMSNorm
  computed in fp32 and cast back, rotary embeddings in fp32, SwiGLU as silu then a product,
  grouped-query K/V repeated to the query heads, each op its own kernel): the bytes
  `telemetry.traffic.ElementwiseTraffic` counts for that block's forward and backward, per
  element of each width (below). A test re-counts the built-in block and holds these figures to
  the count within 2 %.

For the eager block the widths are split by where tensor and sequence parallelism put them:
- the residual stream's (h, /tp under sequence parallelism): the two norms (counted alone:
  `_NORM`, by the residual's bytes r) and the two residual adds (2r + q forward; backward the
  gradients summed at the two branch points, 3r, and under autocast (r > q) each branch's
  gradient cast to the compute dtype, r + q);
- the projections' shared inputs (h, never split: every tensor-parallel rank holds the whole
  sequence there): under autocast each of the P projections that read a norm's output casts it
  (r + q forward, again backward), and backward sums the input gradients of projections that
  share an input, P - 2 additions of 3r;
- per tensor-parallel rank (/tp): the query side (rotary, casts, the attention output's copy:
  `H` per element of a x hd), the key side (`K`, of kv x hd), the repeat of K and V under
  grouped-query attention (`GQA`, of a x hd + kv x hd), the SwiGLU activation (`F`, per ffn
  element); and the rotary tables (`D`, per element of one head, read by every rank).
Counted with the built-in block over 11 shapes (hidden 256-768, 1-16 heads, 1-12 KV heads, ffn
512-2,048) at 128 and 256 tokens, the token slope fitted by least squares: within 1 % of every
count. fp16 moves what bf16 does. Imports no torch.
"""

from __future__ import annotations

from shardwise.planner.models import ModelDims
from shardwise.planner.params import BlockSaves

#: RMSNorm forward / backward bytes per element, by the bytes of its input (the residual):
#: bf16 upcasts to fp32 (40 / 104), fp32 skips the casts (28 / 92)
_NORM = {2: (40.0, 104.0), 4: (28.0, 92.0)}
#: per compute byte q: forward / backward bytes per element of the query side (H), the key
#: side (K), the GQA repeat (GQA), the SwiGLU activation (F) and one head's rotary tables (D)
_SPLIT = {
    2: {"H": (52.0, 52.4), "K": (48.0, 61.4), "GQA": (4.0, 7.7), "F": (10.0, 17.9),
        "D": (16.0, 5.5)},
    4: {"H": (44.0, 41.7), "K": (36.0, 57.2), "GQA": (8.0, 14.6), "F": (20.0, 35.7),
        "D": (16.0, 0.0)},
}


def fused_bytes(model: ModelDims, kind: str, tokens: int, tp: int, sp: bool, q: int, r: int,
                dropout: bool, ffn_elems: int) -> tuple[float, float]:
    """(forward, backward) bytes of one block's fused memory-bound work on one rank
    (`ffn_elems`: the rank's activation elements a token, experts included)."""
    h = model.hidden
    wide = 2 * (r + q) + 2 * (q + 2 * r + (1 if dropout else 0))  # norms, residual adds
    if kind == "moe":
        wide += (3 * model.top_k + 1) * q  # the routed tokens' permutation (`kernels`)
    narrow = (3 if model.gated else 2) * q  # the activation, per ffn element
    fwd = tokens * (wide * h / (tp if sp else 1) + narrow * ffn_elems)
    return fwd, 2 * fwd


def eager_bytes(model: ModelDims, kind: str, tokens: int, tp: int, sp: bool, q: int, r: int,
                dropout: bool, ffn_elems: int) -> tuple[float, float]:
    """(forward, backward) bytes of one eager block's memory-bound work on one rank (module
    docstring). Dropout masks, an MoE block's token permutation and a GeLU activation (one
    kernel each, eager or not) are counted as the fused model counts them."""
    if q not in _SPLIT or r not in _NORM:
        return fused_bytes(model, kind, tokens, tp, sp, q, r, dropout, ffn_elems)
    h, hd = model.hidden, model.hd
    big_h, big_k = model.heads * hd, model.kv * hd
    gqa = big_h + big_k if model.kv < model.heads else 0
    norm_f, norm_b = _NORM[r]
    cast = r + q if r != q else 0  # autocast's casts of the residual stream's dtype
    rep_f = 2 * norm_f + 2 * (2 * r + q) + (2 if dropout else 0)
    rep_b = 2 * norm_b + 2 * 3 * r + 2 * cast + (4 if dropout else 0)
    if kind == "moe":
        perm = (3 * model.top_k + 1) * q
        rep_f, rep_b = rep_f + perm, rep_b + 2 * perm
    projections = 3 + (2 if model.gated else 1)
    whole_f = projections * cast
    whole_b = projections * cast + (projections - 2) * 3 * r
    c = _SPLIT[q]
    out = []
    for i, (rep, whole) in enumerate(((rep_f, whole_f), (rep_b, whole_b))):
        split = c["H"][i] * big_h + c["K"][i] * big_k + c["GQA"][i] * gqa
        act = c["F"][i] if model.gated else (2 * q if i == 0 else 4 * q)
        out.append(tokens * (rep * h / (tp if sp else 1) + whole * h + split / tp
                             + act * ffn_elems + c["D"][i] * hd))
    return out[0], out[1]


def module_recompute_bytes(model: ModelDims, kind: str, tokens: int, tp: int, sp: bool, q: int,
                           r: int, saves: BlockSaves, routed_elems: int,
                           dense_elems: int = 0) -> float:
    """Bytes a block's backward moves again for what the implementation recomputes instead of
    saving (`BlockSaves`): each norm's forward (reads the residual, writes its output), the
    routed experts' activation forward (`routed_elems`: the rank's routed activation elements a
    token) and the dense MLP's or shared experts' (`dense_elems`), counted as the fused model
    counts them."""
    norms = 0.0 if saves.norms else 2 * (r + q) * model.hidden / (tp if sp else 1)
    per_elem = (3 if model.gated else 2) * q
    act = 0.0
    if kind == "moe" and not saves.moe_act:
        act += per_elem * routed_elems
    if not saves.act:
        act += per_elem * dense_elems
    return tokens * (norms + act)
