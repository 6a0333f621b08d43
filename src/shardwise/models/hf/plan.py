"""A shardwise plan from what a Hugging Face model declares about itself.

- blocks: the base model's ModuleList whose entries are the classes `_no_split_modules` names;
- pipeline cut: the base's children with parameters registered before the blocks run on the
  first stage (embeddings), those after them (final norm) and the output embedding on the last;
- tensor parallel: the model's `_tp_plan` (`base_model_tp_plan` plus the head's), translated
  style by style through `HF_TP_STYLES` — an HF style not listed there is refused, never guessed.
  shardwise adds what sequence parallel needs and HF does not declare: the norms between blocks
  and the final norm are `sequence` modules, and the modules holding the colwise / rowwise pairs
  (attention, MLP) are `full_input` regions. What tensor parallel would refuse when it applies
  the plan inside the workers is refused here instead (`_check_appliable`), so the launcher says
  it before any worker starts: an embedding option the vocabulary split cannot honour
  (`max_norm`, `scale_grad_by_freq`, `sparse`; `padding_idx` is supported) and a tied tensor
  two styles would split differently;
- tied groups: found by identity (every tie HF made at build time stays one tensor);
- shape and FLOPs: from the config and the parameter shapes of one block;
- experts: the experts modules of the sparse-MoE blocks `shardwise.models.hf.moe` adapted (their
  pattern for expert parallel; the shape's experts and expert width; FLOPs of the active weights).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from shardwise.models.hf.adapter import HFCausalLM, Layout
from shardwise.models.hf.moe import moe_of
from shardwise.models.plan import (
    TP_STYLES,
    ModelPlan,
    PlanError,
    Stages,
    embedding_refusal,
    find_tied,
    unique_params,
)
from shardwise.shape import ModelShape, hf_sliding_window
from shardwise.telemetry.flops import FlopCounts

# HF tensor-parallel style -> shardwise style. `output` / `embedding` are decided by the module
# (the output or input embedding), see `_translate`.
HF_TP_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "output",
    "colwise_gather_output": "output",
    "embedding_rowwise": "embedding",
    "rowwise_rep": "embedding",
    "replicated_with_grad_allreduce": "replicated",
    "sequence_parallel": "sequence",
}
_NORM_CLASS = ("Norm",)  # class-name fragment of normalisation layers (RMSNorm, LayerNorm)


def find_layout(hf_model: nn.Module) -> Layout:
    """Where the base, blocks, embeddings, final norm and head of `hf_model` are; a model that
    does not have this shape is a PlanError saying what is missing."""
    cls = type(hf_model).__name__
    base_name = getattr(hf_model, "base_model_prefix", "")
    base = getattr(hf_model, base_name, None) if base_name else None
    head = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or head is None:
        raise PlanError(f"{cls} is not a causal language model with a base model and an output "
                        "embedding (AutoModelForCausalLM); shardwise trains those.")
    head_name = next(n for n, m in hf_model.named_children() if m is head)
    no_split = set(getattr(hf_model, "_no_split_modules", None) or ())
    children = list(base.named_children())
    blocks = [n for n, m in children if isinstance(m, nn.ModuleList) and len(m) > 0
              and (type(m[0]).__name__ in no_split or not no_split)]
    if len(blocks) != 1:
        raise PlanError(f"{cls}: cannot find its one list of repeated blocks (the ModuleList of "
                        f"{sorted(no_split) or 'decoder layers'}); found {blocks or 'none'}.")
    at = [n for n, _ in children].index(blocks[0])
    with_params = [n for n, m in children if any(True for _ in m.parameters())]
    before = tuple(n for n in with_params if [c for c, _ in children].index(n) < at)
    after = tuple(n for n in with_params if [c for c, _ in children].index(n) > at)
    if not before:
        raise PlanError(f"{cls}: its base model has no embedding before the blocks.")
    return Layout(base_name, blocks[0], before, after, head_name,
                  len(getattr(base, blocks[0])))


def hf_plan(model: HFCausalLM, seq_len: int) -> ModelPlan:
    """The plan of an adapted HF model (see the module docstring)."""
    lay, cfg = model.layout, model.hf_config
    base = f"{lay.base}."
    blocks = base + lay.blocks
    try:
        tp, tp_unavailable = _tp(model, _dense_tp(model, getattr(model, "hf_tp_plan", {}) or {})), ""
    except PlanError as err:  # matters only for tp > 1 (parallel/checks.py says it then)
        tp, tp_unavailable = {}, str(err)
    return ModelPlan(
        shape=_shape(model, cfg, seq_len),
        blocks=blocks,
        tp=tp,
        tp_unavailable=tp_unavailable,
        stages=Stages(first=tuple(base + n for n in lay.before),
                      last=(*(base + n for n in lay.after), lay.head)),
        attention=_attention_pattern(model, blocks),
        experts=moe.pattern if (moe := moe_of(model)) else "",
        positions="positions",
        flop_counts=_flops(model, cfg, seq_len),
    )


def _dense_tp(model: HFCausalLM, declared: dict[str, str]) -> dict[str, str]:
    """The declared plan without the entries inside the sparse-MoE blocks (HF's packed expert
    styles, the MLP of dense layers under the same name), as moe-gpt's plan leaves its
    feed-forward out: the experts are not split by tensor parallel. Where shardwise has the
    `tokens` style (an MoE block whole on every tp rank, on every token), the blocks take it."""
    moe = moe_of(model)
    if moe is None:
        return declared
    block = moe.pattern.rpartition(".")[0]
    kept = {p: s for p, s in declared.items() if p != block and not p.startswith(block + ".")}
    if kept and "tokens" in TP_STYLES:
        kept[block] = "tokens"
    return kept


def _tp(model: HFCausalLM, declared: dict[str, str]) -> dict[str, str]:
    """The declared HF plan in shardwise's styles, plus the sequence-parallel norms and the
    full-input regions HF leaves implicit. Empty when the model declares no plan."""
    if not declared:
        return {}
    lay = model.layout
    out_name = lay.head
    in_names = {f"{lay.base}.{n}" for n in lay.before
                if isinstance(getattr(model, lay.base)._modules[n], nn.Embedding)}
    tp: dict[str, str] = {}
    for pattern, style in declared.items():
        tp[pattern] = _translate(pattern, style, out_name, in_names)
    blocks = f"{lay.base}.{lay.blocks}"
    block = next(iter(getattr(getattr(model, lay.base), lay.blocks)))
    for name, sub in block.named_children():  # norms between the block's residual branches
        if any(f in type(sub).__name__ for f in _NORM_CLASS):
            tp.setdefault(f"{blocks}.*.{name}", "sequence")
    for name in lay.after:
        sub = getattr(model, lay.base)._modules[name]
        if any(f in type(sub).__name__ for f in _NORM_CLASS):
            tp.setdefault(f"{lay.base}.{name}", "sequence")
    regions = {p.rsplit(".", 1)[0] for p, s in tp.items()
               if s in ("colwise", "rowwise") and p.startswith(blocks + ".*.")}
    for region in sorted(regions):
        if region.count(".") > blocks.count(".") + 1:  # a sub-module of the block, not the block
            tp.setdefault(region, "full_input")
    # first match wins in ModelPlan.tp_style: regions and norms must not shadow their insides
    tp = dict(sorted(tp.items(), key=lambda kv: -kv[0].count(".")))
    _check_appliable(model, tp)
    return tp


# How tensor parallel (shardwise.parallel.tensor_parallel) splits a parameter under each style;
# a parameter of a module outside the plan, or of a `full_input` / `tokens` module, stays whole.
_SPLITS = {("colwise", "weight"): "by row", ("colwise", "bias"): "by row",
           ("output", "weight"): "by row", ("output", "bias"): "by row",
           ("embedding", "weight"): "by row",
           ("rowwise", "weight"): "by column", ("rowwise", "bias"): "replicated",
           ("replicated", "weight"): "replicated", ("replicated", "bias"): "replicated",
           ("sequence", "weight"): "replicated under sequence parallel",
           ("sequence", "bias"): "replicated under sequence parallel"}


def _style(tp: Mapping[str, str], name: str) -> str | None:
    """The style `ModelPlan.tp_style` gives module `name` (first matching pattern)."""
    return next((style for pattern, style in tp.items() if fnmatch.fnmatchcase(name, pattern)),
                None)


def _check_appliable(model: nn.Module, tp: Mapping[str, str]) -> None:
    """PlanError for what `apply_tensor_parallel` would refuse (or fail on) in every worker, so
    that it is said once, by the launcher, before any worker starts (tp > 1 only: the error
    becomes the plan's `tp_unavailable`). Types and split sizes are checked from `tp_sizes`
    (`shardwise.parallel.checks`); these are the rest."""
    for name, module in model.named_modules():
        if _style(tp, name) != "embedding" or not isinstance(module, nn.Embedding):
            continue
        if refusal := embedding_refusal(name, module):
            raise PlanError(refusal)
    for group in find_tied(model):
        _check_tie(group, tp)


def _check_tie(group: tuple[str, ...], tp: Mapping[str, str]) -> None:
    """A tied tensor is one tensor: every module that holds it must split it the same way (an
    input embedding `embedding` and the output projection `output`: both by vocabulary row), or
    it would be split for one module and whole (or split otherwise) for the other."""
    splits = {}
    for param in group:
        module, _, attr = param.rpartition(".")
        style = _style(tp, module)
        splits[param] = (style, _SPLITS.get((style or "", attr), "whole"))
    if len({split for _, split in splits.values()}) > 1:
        ways = "; ".join(f"{param} {split} ({'style ' + repr(style) if style else 'not in the plan'})"
                         for param, (style, split) in splits.items())
        raise PlanError(
            f"the model's tensor-parallel plan would split the tied tensor {' = '.join(group)} "
            f"in different ways: {ways}. A tied tensor is split once, the same way for every "
            "module that holds it: give the input embedding the style \"embedding\" "
            "(HF: \"embedding_rowwise\") and the output projection \"output\" (HF: "
            "\"colwise_rep\"), or untie them (tie_word_embeddings = false).")


def _translate(pattern: str, style: str, out_name: str, in_names: set[str]) -> str:
    """A declared HF style as shardwise's (a user plan may also use shardwise's own styles)."""
    ours = style if style in TP_STYLES else HF_TP_STYLES.get(style)
    if ours is None:
        raise PlanError(f"the model's tensor-parallel plan gives {pattern!r} the Hugging Face "
                        f"style {style!r}, which shardwise does not translate (it translates "
                        f"{', '.join(sorted(HF_TP_STYLES))}, and shardwise's own "
                        f"{', '.join(TP_STYLES)}). Train this model without tensor parallel "
                        "(tp = 1), or give model.hf_tp_plan a plan in those styles.")
    if ours == "output" and pattern != out_name:
        raise PlanError(f"the model's tensor-parallel plan gives {pattern!r} the style {style!r} "
                        f"(a gathered column split), which shardwise supports only on the output "
                        f"embedding {out_name!r}. Use tp = 1, or a plan without it.")
    if ours == "embedding" and pattern not in in_names:
        raise PlanError(f"the model's tensor-parallel plan gives {pattern!r} the style {style!r} "
                        f"(a vocabulary split), which shardwise supports only on the input "
                        f"embedding ({', '.join(sorted(in_names))}). Use tp = 1, or a plan "
                        "without it.")
    return ours


def _attention_pattern(model: HFCausalLM, blocks: str) -> str:
    block = next(iter(model.get_submodule(blocks)))
    names = [n for n, m in block.named_children() if "Attention" in type(m).__name__]
    return f"{blocks}.*.{names[0]}" if names else ""


def _cfg(cfg: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def _shape(model: HFCausalLM, cfg: Any, seq_len: int) -> ModelShape:
    hidden = _cfg(cfg, "hidden_size", "n_embd")
    heads = _cfg(cfg, "num_attention_heads", "n_head")
    moe = moe_of(model)  # an MoE model's ffn is its experts' width, as moe-gpt's
    return ModelShape(params=unique_params(model), layers=model.layout.n_layers, hidden=hidden,
                      heads=heads, kv_heads=_cfg(cfg, "num_key_value_heads", default=heads),
                      ffn=moe.expert_hidden if moe else
                      _cfg(cfg, "intermediate_size", "n_inner", default=4 * hidden),
                      vocab=_cfg(cfg, "vocab_size"), seq_len=seq_len,
                      experts=moe.experts if moe else _cfg(cfg, "num_local_experts", "num_experts"),
                      top_k=moe.top_k if moe else 0,
                      **_window(cfg, model.layout.n_layers))


def _window(cfg: Any, layers: int) -> dict[str, int]:
    """The config's sliding window (`shape.hf_sliding_window`): FLOPs count the keys it leaves."""
    window, windowed = hf_sliding_window(lambda key: getattr(cfg, key, None), layers)
    return {"window": window, "window_layers": windowed}


def _flops(model: HFCausalLM, cfg: Any, seq_len: int) -> FlopCounts:
    """Matmul weights of one block (every 2-D parameter of it: Linear and Conv1D alike) and of
    the output embedding; attention from the config's heads and head width. With sparse-MoE
    blocks, the active weights (router + top-k experts) averaged over the blocks (some may be
    dense: Qwen3-MoE's mlp_only_layers)."""
    lay = model.layout
    blocks = getattr(getattr(model, lay.base), lay.blocks)
    block = next(iter(blocks))
    per_layer = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    moe = moe_of(model)
    if moe is not None:  # 2-D weights of every block (the router's included) + the k experts
        total = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
        per_layer = round((total + moe.layers * moe.active_expert_params) / lay.n_layers)
    head = getattr(model, lay.head).weight
    heads = _cfg(cfg, "num_attention_heads", "n_head", default=1)
    hidden = _cfg(cfg, "hidden_size", "n_embd")
    head_dim = _cfg(cfg, "head_dim", default=hidden // heads)
    window = _window(cfg, lay.n_layers)
    return FlopCounts(n_layers=lay.n_layers, layer_matmul_params=per_layer,
                      head_matmul_params=head.shape[0] * head.shape[1], n_heads=heads,
                      head_dim=head_dim, seq_len=seq_len, causal=True,
                      window=window["window"],
                      window_share=window["window_layers"] / lay.n_layers if lay.n_layers else 0.0)
