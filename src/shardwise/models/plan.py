"""The model plan: what a model declares about how it may be split.

`shardwise.parallel` reads only this — never a model's module names of its own — so any
`nn.Module` that declares a plan trains under every layout the plan allows:

- `blocks`: the dotted name of the `nn.ModuleList` / `nn.ModuleDict` of repeated blocks; the
  unit of FSDP sharding, activation checkpointing, compile and pipeline cuts. Without blocks the
  whole model is one FSDP unit and activation checkpointing has nothing to wrap.
- `tp`: module-name patterns (fnmatch, matched against `named_modules()` names) and how tensor
  parallel splits each: `colwise` / `rowwise` (a Linear split by output / input features),
  `embedding` (an Embedding split by vocabulary rows), `output` (the vocabulary projection: split
  by vocabulary, its logits stay sharded for the loss-parallel cross entropy), `sequence` (a norm
  whose weight is replicated and, under sequence parallel, acts on this rank's tokens only),
  `full_input` (a module, typically the attention, whose own code must see every token: its first
  input is gathered along the sequence once, and the column-parallel modules inside it take it
  as it is; column-parallel modules elsewhere gather their own input, once for siblings that
  take the same tensor), `replicated` (a module whose weight every tp rank holds whole but
  which sees only this rank's heads, like Qwen3's per-head q/k norms: its gradient is summed over
  tp). Empty: the model has no tensor-parallel plan and tp > 1 is refused.
- `stages`: how a pipeline stage is cut — the modules only the first stage runs (before the
  blocks) and only the last (after them). A stage is the model with the other stages' blocks
  removed and those modules set to None, so parameter names are the same at every pp degree; the
  model's forward must skip a module that is None (take hidden states without its first modules,
  return them without its last). None: no pipeline plan, pp > 1 is refused.
- `tied`: groups of parameter names that are one tensor (an input embedding shared with the output
  projection), found by identity on the whole model — nothing to declare. Kept one tensor under
  every layout; under pipeline parallel, where a group's members live on different stages, their
  gradients are summed across those stages.
- `attention`, `experts`: patterns of the attention and expert modules (for context and expert
  parallel). Context parallel replaces the attention core of each `attention` module: the module
  computes it through its attribute `attention_fn(q, k, v)` (causal; q (B, H, T, D), k/v
  (B, H_kv, T, D), K/V heads not repeated), which `shardwise.parallel.context` swaps.
  Each `experts` module holds E experts as parameters whose dim 0 is the expert index, and its
  `forward(tokens, counts)` takes tokens sorted by expert (`counts[e]` for expert e, int64 (E,))
  and returns their outputs in that order; expert parallel keeps E/N experts per rank and
  exchanges the tokens around it (`shardwise.parallel.expert`). Under tensor parallel an MoE
  feed-forward is a `tokens` module: whole on every tp rank, run on every token of the
  micro-batch (gathered along the sequence under sequence parallel); expert parallel with tp is
  not available yet.
- Auxiliary losses (an MoE router's balance loss) are not declared here: a module adds its term
  inside forward with `shardwise.models.aux_loss.add_aux_loss`, on the loss's own path. Module
  state that changes outside gradients (an MoE selection bias) is updated by the module's
  `shardwise_end_step(sum_over_data, updated)`, called after every optimizer step.
- `positions`: the keyword argument of the model's forward that takes the true positions (int64,
  (T,)) of the tokens it is given, e.g. "positions" or "position_ids"; context parallel passes
  them, since each rank holds non-contiguous chunks of every sequence. Empty: cp > 1 is refused.
- `loss`: None for next-token cross entropy on (logits, targets); or a function of (outputs,
  targets) returning the sum of the per-target losses over real targets (ignore index -100), so
  that shardwise divides once by the step's global count of real targets.
- `shape`: the torch-free summary FLOPs, memory and the planner work from (`ModelShape`, defined
  in `shardwise.shape` and importable from here: the one shape vocabulary, see there).

A module with an attribute `sequence_shards` is told, under sequence parallel, by how many ways
the hidden states between blocks are split along the sequence (a model that derives positions
from its input's length on a pipeline stage needs it).

A model declares its plan with a `shardwise_plan()` method, or a builder attaches one with
`attach_plan(module, plan)`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardwise.shape import ModelShape
from shardwise.utils.constants import IGNORE_INDEX

if TYPE_CHECKING:
    from torch import nn

__all__ = ["IGNORE_INDEX", "TP_STYLES", "LossFn", "ModelPlan", "ModelShape", "PlanError", "Stages",
           "attach_plan", "described", "find_tied", "plan_of", "unique_params"]

TP_STYLES = ("colwise", "rowwise", "embedding", "output", "sequence", "full_input", "replicated",
             "tokens")
_ATTR = "_shardwise_plan"


@dataclass(frozen=True)
class Stages:
    """The pipeline cut: modules (dotted names) before the blocks and after them."""

    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()


LossFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class ModelPlan:
    shape: ModelShape
    blocks: str = ""
    tp: Mapping[str, str] = field(default_factory=dict)
    stages: Stages | None = None
    tied: tuple[tuple[str, ...], ...] = ()
    attention: str = ""
    experts: str = ""
    positions: str = ""
    loss: LossFn | None = None
    flop_counts: Any = None  # a telemetry.flops.FlopCounts when the model can state its FLOPs
    # why `tp` is empty although the model declares a plan (one shardwise cannot translate):
    # said when tp > 1 is asked, so that the model still trains on every other layout
    tp_unavailable: str = ""
    # Filled in by `plan_of` from the module itself (not declared):
    n_blocks: int = 0
    # module name -> (style, the size tensor parallel splits, or -1 if the module's type cannot
    # take the style)
    tp_sizes: Mapping[str, tuple[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = {p: s for p, s in self.tp.items() if s not in TP_STYLES}
        if bad:
            raise PlanError(f"the model's tensor-parallel plan uses unknown style(s) {bad}; the "
                            f"styles are {', '.join(TP_STYLES)}.")
        object.__setattr__(self, "tp", dict(self.tp))
        object.__setattr__(self, "tied", tuple(tuple(g) for g in self.tied))

    @property
    def supports_tp(self) -> bool:
        return bool(self.tp)

    @property
    def supports_pp(self) -> bool:
        return self.stages is not None and bool(self.blocks)

    def tp_style(self, module_name: str) -> str | None:
        """The tensor-parallel style of a module (first matching pattern), or None."""
        return next((style for pattern, style in self.tp.items()
                     if fnmatch.fnmatchcase(module_name, pattern)), None)

    def tied_group(self, name: str) -> tuple[str, ...] | None:
        return next((g for g in self.tied if name in g), None)


class PlanError(ValueError):
    """A plan that contradicts its model (a name it declares does not exist, a style that does
    not fit the module). Raised before any worker trains."""


def attach_plan(module: Any, plan: ModelPlan) -> Any:
    """Attach `plan` to `module` (for builders of modules that have no `shardwise_plan`)."""
    object.__setattr__(module, _ATTR, plan)
    return module


def plan_of(module: Any) -> ModelPlan:
    """The plan `module` declares (attached, or from its `shardwise_plan()` method; a module
    that declares none is data-parallel only), with its tied groups found on the whole module."""
    plan = getattr(module, _ATTR, None)
    if plan is None:
        declare = getattr(module, "shardwise_plan", None)
        plan = declare() if callable(declare) else None
    if plan is None:
        plan = ModelPlan(shape=ModelShape(params=unique_params(module)))
    if not isinstance(plan, ModelPlan):
        raise PlanError(f"{type(module).__name__}.shardwise_plan() returned "
                        f"{type(plan).__name__}, not a shardwise.models.plan.ModelPlan.")
    return dataclasses.replace(plan, tied=find_tied(module), n_blocks=_count_blocks(module, plan),
                               tp_sizes=_tp_sizes(module, plan))


def _count_blocks(module: Any, plan: ModelPlan) -> int:
    if not plan.blocks:
        return 0
    try:
        container = module.get_submodule(plan.blocks)
    except AttributeError:
        raise PlanError(f"the model's plan names its blocks {plan.blocks!r}, but "
                        f"{type(module).__name__} has no such sub-module. Set `blocks` to the "
                        "dotted name of the ModuleList (or ModuleDict) of repeated blocks.") from None
    if type(container).__name__ not in ("ModuleList", "ModuleDict"):
        raise PlanError(f"the model's plan names {plan.blocks!r} as its blocks, but that is a "
                        f"{type(container).__name__}; it must be an nn.ModuleList or "
                        "nn.ModuleDict of the repeated blocks.")
    for path in (plan.stages.first + plan.stages.last) if plan.stages else ():
        try:
            module.get_submodule(path)
        except AttributeError:
            raise PlanError(f"the model's pipeline plan names {path!r}, which "
                            f"{type(module).__name__} does not have. List the modules that run "
                            "before / after the blocks by their dotted names.") from None
    return len(container)


_SPLIT = {"colwise": ("Linear", "out_features"), "output": ("Linear", "out_features"),
          "rowwise": ("Linear", "in_features"), "embedding": ("Embedding", "num_embeddings")}


def _tp_sizes(module: Any, plan: ModelPlan) -> dict[str, tuple[str, int]]:
    sizes: dict[str, tuple[str, int]] = {}
    matched: set[str] = set()
    for name, sub in module.named_modules():
        style = plan.tp_style(name)
        if style is None:
            continue
        matched.update(p for p in plan.tp if fnmatch.fnmatchcase(name, p))
        if style in ("sequence", "full_input", "replicated", "tokens"):
            sizes[name] = (style, 0)
            continue
        cls, attr = _SPLIT[style]
        fits = any(c.__name__ == cls for c in type(sub).__mro__)
        sizes[name] = (style, getattr(sub, attr) if fits else -1)
    unused = [p for p in plan.tp if p not in matched]
    if unused:
        raise PlanError(f"the model's tensor-parallel plan has pattern(s) {unused} that match no "
                        f"module of {type(module).__name__}; patterns match the names "
                        "named_modules() gives (e.g. \"blocks.*.mlp.fc1\").")
    return sizes


def unique_params(module: Any) -> int:
    """Parameter count with every tied tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def find_tied(module: Any) -> tuple[tuple[str, ...], ...]:
    """Groups of parameter names that are the same tensor (named_parameters lists only one)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return tuple(tuple(g) for g in names.values() if len(g) > 1)


def described(plan: ModelPlan) -> dict[str, Any]:
    """The plan as plain data (for the manifest and `--print-placement`)."""
    return {"blocks": plan.blocks, "tp": dict(plan.tp),
            "stages": None if plan.stages is None else
            {"first": list(plan.stages.first), "last": list(plan.stages.last)},
            "tied": [list(g) for g in plan.tied], "attention": plan.attention,
            "experts": plan.experts, "loss": "next-token" if plan.loss is None else
            getattr(plan.loss, "__qualname__", repr(plan.loss)),
            "n_blocks": plan.n_blocks, "shape": dict(plan.shape.__dict__)}


def embedding_refusal(name: str, embedding: nn.Embedding) -> str:
    """Why the vocabulary-parallel lookup cannot run `embedding` (empty: it can), as a message
    for the user. Each rank looks up every token it does not hold from its local row 0 and
    masks the result, and that stand-in breaks the options that act on the rows a lookup
    touches: `max_norm` renormalises them in place (row 0 of every rank would be renormalised
    for tokens it does not hold), `scale_grad_by_freq` divides a row's gradient by how often
    the micro-batch looks it up (row 0 would count the other ranks' tokens); a `sparse`
    gradient cannot be the DTensor shard the optimizer and the gradient norm take.
    `padding_idx` is supported (`VocabLookup`)."""
    options = {"max_norm": embedding.max_norm, "scale_grad_by_freq": embedding.scale_grad_by_freq,
               "sparse": embedding.sparse}
    used = {key: value for key, value in options.items()
            if value is not None and value is not False}
    if not used:
        return ""
    named = " and ".join(f"{key} = {value}" for key, value in used.items())
    return (f"{name} is an embedding with {named}, which tensor parallel's vocabulary-split "
            "lookup (style `embedding`) does not support: each rank looks up the tokens it does "
            "not hold from a stand-in row. Use tp = 1 (every data-parallel layout and pipeline "
            f"parallel train it), or build the embedding without {' and '.join(used)}.")
