"""Sparse mixture-of-experts blocks of Hugging Face models (Qwen3-MoE, Mixtral, ...) under
shardwise's expert contract, with HF's parameter names and HF's numbers.

transformers 5.x stores the experts of these models as one module with stacked 3-D parameters
`gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) (dim 0: the expert), next to a top-k router
(`gate`: a (E, H) weight; returns logits, top-k weights, top-k indices) inside the MoE block.
`adapt_moe` finds these blocks generically (the parameters' shapes, the router's) and swaps
the classes of both modules — never their parameters, so `model.layers.0.mlp.experts.gate_up_proj`
keeps its name and checkpoints from `hf_path`, `shardwise export --format hf` and `to_hf()` need
no renaming (the subclasses are HF's classes plus a forward, so HF's isinstance checks still hold):

- the experts: `forward(tokens, counts)` (shardwise's contract, `shardwise.models.plan`): tokens
  sorted by expert, `counts[e]` of them for expert e; each contiguous group runs HF's SwiGLU
  (`_apply_gate` of `gate_up_proj`, then `down_proj`). Expert parallel keeps E/N experts per rank
  and calls this forward on the local ones (`shardwise.parallel.expert`).
- the block: HF's own router, a sort of the (token, slot) assignments by expert (in HF's
  order), the experts on the sorted tokens, back to (token, slot) order, times the top-k
  weights, and the k contributions of a token combined as HF's configured experts
  implementation does (its default `grouped_mm`: a sum over the k slots; `eager`: added in
  expert order from zeros). Per expert the products are HF's, so at world 1 the logits are
  bitwise the raw HF model's. (`to_hf()` shares these modules: its forward is the same, but
  in training mode it adds this balancing term besides HF's own.)

Balancing loss: with the config's `output_router_logits = true` (HF adds its router loss only
then) and `router_aux_loss_coef > 0`, every MoE block adds the Switch term of moe-gpt — E *
sum_i f_i * P_i of its micro-batch (f_i: the fraction of the k-assignments that chose expert i,
P_i: expert i's mean router probability; 1.0 when balanced), times the micro-batch's tokens —
through `add_aux_loss`, on the loss path under every layout (pipeline stages included), scaled
by `router_aux_loss_coef * top_k / (MoE layers)`. That scale keeps HF's magnitude: HF's
`load_balancing_loss_func` normalises f_i by tokens, not assignments (balanced = top_k), and
pools the logits of all layers and of the whole batch it is given before taking the product,
whereas shardwise's term is per layer and per micro-batch (so that micro-batching and sharding
never change the objective). The two are equal for one MoE layer and one micro-batch; with
layers that route differently, HF's pooled product is not the mean of the per-layer ones.
Under context parallel the assignment fractions are summed over the cp ranks, as moe-gpt's
(`shardwise_sequence_split`). The routing figures of a step (`shardwise_end_step`) are moe-gpt's,
for the expert telemetry.

Refused (PlanError): a block with anything besides its router and experts (a shared expert), a
router with parameters or buffers other than its (E, H) weight (grouped or biased selection), a
router jitter, and experts with biases, a transposed or interleaved gate/up layout, or a post-
expert norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.aux_loss import add_aux_loss
from shardwise.models.moe import CountRouting, switch_balance_loss
from shardwise.models.plan import PlanError

__all__ = ["HFMoE", "adapt_moe", "moe_of"]

_ATTR = "_shardwise_hf_moe"
_SUPPORTED = "Qwen3-MoE, Mixtral: a block of only a top-k router and the experts"


@dataclass(frozen=True)
class HFMoE:
    """What the plan needs to know about an adapted model's sparse-MoE blocks."""

    pattern: str  # the experts modules, e.g. "model.layers.*.mlp.experts"
    experts: int
    top_k: int
    expert_hidden: int
    layers: int  # blocks with a sparse-MoE feed-forward
    active_expert_params: int  # expert weights a token multiplies per MoE layer (top-k SwiGLUs)


@dataclass(frozen=True)
class _Settings:
    router: str  # the router's attribute in the MoE block
    experts: str  # the experts' attribute
    num_experts: int
    top_k: int
    aux_coef: float  # router_aux_loss_coef * top_k / MoE layers; 0: not trained


class _Experts:
    """The forward of an adapted experts module (first in the MRO of HF's class)."""

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs of tokens sorted by expert (`counts[e]` for expert e of the experts this module
        holds), in the same order. HF's SwiGLU per expert: the same matmuls per row as HF's
        grouped and eager implementations."""
        this: Any = self
        outs = []
        # the split sizes are read on the host (one sync per layer and micro-batch)
        for e, chunk in enumerate(tokens.split(counts.tolist())):
            hidden = this._apply_gate(F.linear(chunk, this.gate_up_proj[e]))
            outs.append(F.linear(hidden, this.down_proj[e]))
        return torch.cat(outs) if outs else tokens.new_zeros(tokens.shape)


class _Block:
    """The forward and end-of-step hook of an adapted sparse-MoE block."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        this: Any = self
        s: _Settings = this._shardwise_moe
        router, experts = getattr(this, s.router), getattr(this, s.experts)
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        logits, weights, idx = router(flat)
        n, k, e = flat.shape[0], idx.shape[-1], s.num_experts
        assigned = idx.reshape(-1)  # (n * k): token-major, slot-minor
        counts = torch.bincount(assigned, minlength=e)
        implementation = getattr(getattr(experts, "config", None), "_experts_implementation", "")
        order = _order_by_expert(assigned, n, k, implementation == "eager")
        token = order // k
        out = experts(flat[token], counts)
        weighted = out * weights.reshape(-1)[order].unsqueeze(-1)
        if implementation == "eager":  # HF's eager experts: index_add_ expert by expert
            y = flat.new_zeros(flat.shape).index_add(0, token, weighted.to(flat.dtype))
        else:  # HF's grouped_mm experts: back to (token, slot) order, summed over the slots
            unsorted = torch.empty_like(weighted).index_copy(0, order, weighted)
            y = unsorted.view(n, k, -1).sum(1).to(flat.dtype)
        if this.training:  # reported whatever the coefficient, trained with one
            aux = switch_balance_loss(counts, logits.float().softmax(-1), k,
                               this.__dict__.get("_shardwise_sum_over_sequence"))
            if s.aux_coef > 0:
                y = add_aux_loss(y, aux * s.aux_coef)
            weight = router.weight
            if torch.is_grad_enabled() and weight.requires_grad:
                stats = torch.stack([counts.new_zeros((), dtype=torch.float64),
                                     aux.detach().double(),
                                     counts.new_tensor(n, dtype=torch.float64)])
                # + 0: a node on the router weight's gradient path (see CountRouting)
                y = y + 0.0 * CountRouting.apply(weight, this, counts, stats).sum()
        return y.reshape(shape)

    def shardwise_sequence_split(self, sum_over_sequence: Callable[[torch.Tensor], torch.Tensor]
                                 ) -> None:
        """Context parallel holds each sequence on several ranks: the balancing loss's
        assignment fractions are summed over them (`shardwise.parallel.context`)."""
        self.__dict__["_shardwise_sum_over_sequence"] = sum_over_sequence

    @torch.no_grad()
    def shardwise_end_step(self, sum_over_data: Callable[[torch.Tensor], torch.Tensor],
                           updated: bool) -> dict[str, torch.Tensor]:
        """The step's routing figures summed over the data-parallel ranks (moe-gpt's keys:
        HF's routers drop nothing and have no selection bias); resets them."""
        this: Any = self
        load = sum_over_data(this.step_load.clone())
        stats = sum_over_data(this.step_stats.clone())
        this.step_load.zero_()
        this.step_stats.zero_()
        return {"load": load, "dropped": stats[0], "aux_sum": stats[1], "tokens": stats[2],
                "bias": torch.zeros(load.numel(), dtype=torch.float32, device=load.device)}


def _order_by_expert(assigned: torch.Tensor, n: int, k: int, eager: bool) -> torch.Tensor:
    """The (token, slot) assignments grouped by expert, within each group in the order HF's
    experts implementation has them: a matmul's rows can round differently at another position
    of its block, so the same order is what makes the products HF's bit for bit. `grouped_mm`:
    HF's `torch.sort` of the expert ids; eager: slot-major, then token (its `torch.where`)."""
    if not eager:
        return torch.sort(assigned).indices
    slot_major = torch.arange(n * k, device=assigned.device).view(n, k).t().reshape(-1)
    return slot_major[assigned[slot_major].argsort(stable=True)]


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(mixin: type, base: type) -> type:
    """HF's class with `mixin`'s methods first (one class per pair, so instances share it)."""
    key = (mixin, base)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"Shardwise{base.__name__}", (mixin, base),
                             {"__module__": __name__, "__qualname__": f"Shardwise{base.__name__}"})
    return _CLASSES[key]


def moe_of(model: nn.Module) -> HFMoE | None:
    """The sparse-MoE summary `adapt_moe` attached to `model` (None: a dense model)."""
    return getattr(model, _ATTR, None)


def adapt_moe(model: nn.Module, base: str, blocks: str, config: Any) -> HFMoE | None:
    """Give every sparse-MoE block of `model.<base>.<blocks>` shardwise's expert contract (see
    the module docstring); None when the model has none. PlanError for what is not supported."""
    container = model.get_submodule(f"{base}.{blocks}")
    found: list[tuple[str, nn.Module, str, nn.Module, str, nn.Module]] = []
    for index, block in container.named_children():
        for rel, module in block.named_modules():
            stacked = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
            if not stacked:
                continue
            where = f"{base}.{blocks}.{index}.{rel}"
            if not {"gate_up_proj", "down_proj"} <= set(stacked):
                raise PlanError(
                    f"{where} ({type(module).__name__}) holds stacked 3-D parameters "
                    f"{sorted(stacked)}, an experts layout shardwise does not know; it runs "
                    f"experts stored as gate_up_proj (E, 2I, H) and down_proj (E, H, I) ("
                    f"{_SUPPORTED}). Use such a model, or model.family = \"moe-gpt\".")
            parent_rel, _, attr = rel.rpartition(".")
            parent = block.get_submodule(parent_rel) if parent_rel else block
            block_name = f"{base}.{blocks}.{index}" + (f".{parent_rel}" if parent_rel else "")
            router_attr = _check_block(parent, block_name, attr, module, config)
            found.append((f"{base}.{blocks}.*.{rel}", parent, router_attr,
                          getattr(parent, router_attr), attr, module))
    if not found:
        return None
    patterns = {pattern for pattern, *_ in found}
    shapes = {(m.gate_up_proj.shape[0], r.top_k, m.down_proj.shape[2])
              for _, _, _, r, _, m in found}
    if len(patterns) != 1 or len(shapes) != 1:
        raise PlanError(f"the model's sparse-MoE blocks differ between layers ({sorted(patterns)}, "
                        f"(experts, top_k, expert width) {sorted(shapes)}); shardwise's plan "
                        "names one experts pattern of one shape. Use a model whose MoE layers "
                        "are alike.")
    (num, top_k, width), = shapes
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) \
        if getattr(config, "output_router_logits", False) else 0.0
    for _, parent, router_attr, _, attr, experts in found:
        experts.__class__ = _subclass(_Experts, type(experts))
        parent.__class__ = _subclass(_Block, type(parent))
        object.__setattr__(parent, "_shardwise_moe", _Settings(
            router_attr, attr, num, top_k, coef * top_k / len(found)))
        # the step's routing statistics (not saved): per-expert assignments; dropped
        # assignments (always 0 here), tokens x the Switch loss, tokens routed
        device = experts.gate_up_proj.device
        parent.register_buffer("step_load", torch.zeros(num, dtype=torch.int64, device=device),
                               persistent=False)
        parent.register_buffer("step_stats", torch.zeros(3, dtype=torch.float64, device=device),
                               persistent=False)
    hidden = found[0][5].gate_up_proj.shape[2]
    summary = HFMoE(patterns.pop(), num, top_k, width, len(found), top_k * 3 * hidden * width)
    object.__setattr__(model, _ATTR, summary)
    return summary


def _check_block(block: nn.Module, name: str, experts_attr: str, experts: nn.Module,
                 config: Any) -> str:
    """The router's attribute in `block`; PlanError for what shardwise does not run."""
    cls = type(block).__name__
    num, two_i, hidden = experts.gate_up_proj.shape
    down = tuple(experts.down_proj.shape)
    extra = [n for n, p in experts.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    flags = {"has_bias": False, "is_transposed": False, "has_post_expert_norm": False,
             "has_gate": True, "is_concatenated": True}
    off = [f"{f} = {getattr(experts, f)}" for f, want in flags.items()
           if getattr(experts, f, want) != want]
    if extra or off or two_i % 2 or down != (num, hidden, two_i // 2) \
            or not callable(getattr(experts, "_apply_gate", None)):
        what = ", ".join(off + [f"parameters {extra}"] * bool(extra)) or \
            f"gate_up_proj {tuple(experts.gate_up_proj.shape)}, down_proj {down}"
        raise PlanError(
            f"{name}.{experts_attr} ({type(experts).__name__}): {what}; shardwise runs experts "
            "with gate_up_proj (E, 2I, H) and down_proj (E, H, I), no biases, concatenated "
            f"[gate; up], no post-expert norm ({_SUPPORTED}). Use such a model, or "
            "model.family = \"moe-gpt\".")
    others = {n: m for n, m in block.named_children()
              if n != experts_attr and any(True for _ in m.parameters())}
    routers = [n for n, m in others.items()
               if isinstance(getattr(m, "weight", None), torch.Tensor)
               and tuple(m.weight.shape) == (num, hidden) and isinstance(getattr(m, "top_k", None),
                                                                        int)]
    if len(routers) != 1:
        raise PlanError(
            f"{name} ({cls}) has no top-k router shardwise recognises next to its experts (a "
            f"child with a ({num}, {hidden}) `weight` and `top_k`, returning logits, top-k "
            f"weights and indices); its children are {sorted(others) or 'none'}. Use a model "
            f"of this kind ({_SUPPORTED}), or model.family = \"moe-gpt\".")
    router_attr = routers[0]
    rest = sorted(n for n in others if n != router_attr)
    if rest:
        raise PlanError(
            f"{name} ({cls}) has, besides its router `{router_attr}` and experts "
            f"`{experts_attr}`, the module(s) {rest} (a shared expert), which shardwise's Hugging "
            f"Face MoE support does not run yet. Use a model without ({_SUPPORTED}), or "
            "model.family = \"moe-gpt\" with model.moe_shared_expert = true.")
    router = getattr(block, router_attr)
    state = [n for n, _ in router.named_parameters() if n != "weight"] + \
        [n for n, _ in router.named_buffers()]
    if state:
        raise PlanError(
            f"{name}.{router_attr} ({type(router).__name__}) has {state} besides its weight (a "
            "selection bias or grouped routing), which shardwise does not reproduce; it runs "
            f"plain softmax top-k routers ({_SUPPORTED}). Use such a model, or "
            "model.family = \"moe-gpt\" (model.moe_balance = \"bias\" is DeepSeek-V3's bias).")
    jitter = getattr(block, "jitter_noise", 0) or getattr(config, "router_jitter_noise", 0)
    if jitter:
        raise PlanError(
            f"{name} ({cls}) multiplies its input by random jitter (router_jitter_noise = "
            f"{jitter}) while training, which no two layouts would draw alike. Set "
            "router_jitter_noise = 0 in the config.")
    return router_attr
