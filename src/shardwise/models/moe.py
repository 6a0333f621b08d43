"""The built-in mixture-of-experts GPT (`model.family = "moe-gpt"`): the GPT's attention, norms,
rotary embeddings and pipeline cut (`shardwise.models.gpt`), with an MoE feed-forward.

Feed-forward of a block: a linear router scores the E experts (softmax); each token goes to its
top-k (k > 1: the k weights renormalised to sum to 1; k = 1: the raw probability, so the router
learns from the main loss, as in Switch); SwiGLU experts whose weights are stacked 3-D parameters
(E, ...) (`GroupedExperts`, what expert parallel shards along dim 0); an optional always-on shared
expert. Routing is per micro-batch and local to it, so every layout routes the same way.

Balancing (`model.moe_balance`):
- "aux-loss": the Switch/GShard loss E * sum_i f_i * P_i per micro-batch (f_i the fraction of
  the micro-batch's assignments that chose expert i, P_i its mean router probability), times the
  micro-batch's tokens and `moe_aux_coef`, added to the objective through
  `shardwise.models.aux_loss` (divided by the step's global target count like the main loss).
- "bias": DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias (a buffer, saved in
  checkpoints) is added to the scores for *selection only*; after each optimizer step
  `shardwise_end_step` sums the step's per-expert load over the data-parallel ranks and moves
  each bias by `moe_bias_rate` towards balance (+rate if under-loaded, -rate if over) — no
  gradient, and the same update on every layout since it sees the global load.
Routing (`model.moe_routing`): "dropless" (default), or "capacity": each expert takes at most
ceil(factor * tokens * k / E) of a micro-batch's assignments, first come (token order) first
served; the rest are dropped (that expert adds nothing for them) and counted. Under context
parallel "first come" is the whole micro-batch's order: the cp ranks gather each other's
assignments (indices only) and each keeps exactly the ones the single process keeps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.aux_loss import add_aux_loss
from shardwise.models.gpt import (
    GPT,
    Attention,
    FeedForward,
    GPTConfig,
    RMSNorm,
    TransformerBlock,
)
from shardwise.models.plan import ModelPlan
from shardwise.shape import ModelShape
from shardwise.spec.model import MoeGptFields


class WholeSequence(Protocol):
    """Context parallel's view of the whole sequence (`parallel.context.SequenceSplit`)."""

    active: bool
    rank: int
    size: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor: ...
    def gather(self, t: torch.Tensor) -> torch.Tensor: ...
    def token_index(self, rows: int, local_len: int, device: torch.device) -> torch.Tensor: ...


@dataclass(frozen=True)
class MoEConfig:
    gpt: GPTConfig
    experts: int
    top_k: int
    expert_hidden: int
    shared_expert: bool = False
    balance: str = "aux-loss"
    aux_coef: float = 0.01
    bias_rate: float = 1e-3
    capacity_factor: float = 0.0  # 0: dropless

    @classmethod
    def from_fields(cls, model: MoeGptFields, vocab_size: int, seq_len: int) -> MoEConfig:
        gpt = GPTConfig.from_fields(model, vocab_size=vocab_size, seq_len=seq_len)
        return cls(gpt, model.moe_experts, model.moe_top_k, model.moe_ffn_hidden or gpt.ffn_hidden,
                   model.moe_shared_expert, model.moe_balance, model.moe_aux_coef,
                   model.moe_bias_rate,
                   model.moe_capacity_factor if model.moe_routing == "capacity" else 0.0)

    def shape(self, params: int) -> ModelShape:
        """The GPT's shape with this feed-forward: `ffn` is one expert's width."""
        return dataclasses.replace(self.gpt.shape(params), ffn=self.expert_hidden,
                                   experts=self.experts, top_k=self.top_k,
                                   shared_experts=int(self.shared_expert))


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights w1, w3 (E, d, h) and w2 (E, h, d).

    The contract expert parallel relies on (the plan's `experts` entry): every parameter's dim 0
    is the expert index, and `forward(tokens, counts)` takes tokens sorted by expert with
    `counts[e]` of them for expert e (of this module's `num_experts`), returning their outputs in
    the same order. Expert parallel keeps E/N experts per rank and exchanges tokens around it.
    """

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, d_model))

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        # the split sizes are read on the host (one sync per layer and micro-batch)
        for e, chunk in enumerate(tokens.split(counts.tolist())):
            outs.append((F.silu(chunk @ self.w1[e]) * (chunk @ self.w3[e])) @ self.w2[e])
        if not outs:
            return tokens.new_zeros(tokens.shape)
        return torch.cat(outs)


class Router(nn.Module):
    """Linear scores over the experts, and the selection bias of "bias" balancing."""

    def __init__(self, d_model: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(experts))  # persistent: checkpoint state


class MoEFeedForward(nn.Module):
    """Router, grouped experts, optional shared expert; keeps the step's routing statistics."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, e = cfg.gpt.d_model, cfg.experts
        self.router = Router(d, e)
        self.experts = GroupedExperts(e, d, cfg.expert_hidden)
        self.shared = FeedForward(dataclasses.replace(cfg.gpt, ffn_hidden=cfg.expert_hidden)) \
            if cfg.shared_expert else None
        # the step's statistics (not saved): per-expert assignments, dropped assignments,
        # tokens x the aux loss, tokens routed
        self.register_buffer("step_load", torch.zeros(e, dtype=torch.int64), persistent=False)
        self.register_buffer("step_stats", torch.zeros(3, dtype=torch.float64), persistent=False)
        # under context parallel: sums over the cp ranks, which hold the rest of each sequence
        self._sum_over_sequence: WholeSequence | None = None

    def shardwise_sequence_split(self, split: WholeSequence) -> None:
        """Context parallel splits each sequence over ranks; the balancing loss's assignment
        fractions are then summed over them, and capacity routing drops by the whole sequence's
        order (`shardwise.parallel.context`)."""
        self._sum_over_sequence = split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, e = flat.shape[0], self.cfg.top_k, self.cfg.experts
        probs = self.router.gate(flat).float().softmax(-1)  # (n, E)
        select = probs + self.router.expert_bias if self.cfg.balance == "bias" else probs
        idx = select.detach().topk(k, dim=-1).indices  # (n, k)
        weights = probs.gather(-1, idx)
        if k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        assigned = idx.reshape(-1)
        counts = torch.bincount(assigned, minlength=e)
        order = assigned.argsort(stable=True)  # by expert, token order within each
        kept = counts
        split = self._sum_over_sequence
        if self.cfg.capacity_factor > 0 and split is not None and split.active:
            rows = shape[0] if x.dim() == 3 else 1  # (B, T, d): B sequences of T local tokens
            whole = math.ceil(self.cfg.capacity_factor * n * split.size * k / e)
            order, kept = _apply_capacity_over_sequence(order, assigned, k, e, whole, split,
                                                        rows, n // rows)
        elif self.cfg.capacity_factor > 0:
            order, kept = _apply_capacity(order, assigned, counts,
                                          math.ceil(self.cfg.capacity_factor * n * k / e))
        token = order // k
        out = self.experts(flat[token], kept)
        gate = weights.reshape(-1)[order].unsqueeze(-1)
        y = flat.new_zeros(flat.shape).index_add(0, token, (out.float() * gate).to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)
        aux = None
        if self.training:  # (reported whatever the balancing; trained with "aux-loss")
            aux = switch_balance_loss(counts, probs, k, self._sum_over_sequence)
            if self.cfg.balance == "aux-loss" and self.cfg.aux_coef > 0:
                y = add_aux_loss(y, aux * self.cfg.aux_coef)
        weight = self.router.gate.weight
        if self.training and torch.is_grad_enabled() and weight.requires_grad:
            stats = torch.stack([(counts - kept).sum().double(),
                                 aux.detach().double() if aux is not None else counts.new_zeros(
                                     (), dtype=torch.float64),
                                 counts.new_tensor(n, dtype=torch.float64)])
            # + 0: a node on the router weight's gradient path only (see CountRouting)
            y = y + 0.0 * CountRouting.apply(weight, self, counts, stats).sum()
        return y.reshape(shape)

    @torch.no_grad()
    def shardwise_end_step(self, sum_over_data: Callable[[torch.Tensor], torch.Tensor],
                           updated: bool) -> dict[str, torch.Tensor]:
        """After the optimizer step (every rank that holds this module, the same steps): the
        step's global routing figures; with "bias" balancing and an update made, move the
        selection bias towards balance. Resets the step's statistics."""
        load = sum_over_data(self.step_load.clone())
        stats = sum_over_data(self.step_stats.clone())
        if self.cfg.balance == "bias" and updated:
            load_f = load.float()
            self.router.expert_bias += self.cfg.bias_rate * torch.sign(load_f.mean() - load_f)
        self.step_load.zero_()
        self.step_stats.zero_()
        return {"load": load, "dropped": stats[0], "aux_sum": stats[1], "tokens": stats[2],
                "bias": self.router.expert_bias.detach().clone()}


def switch_balance_loss(counts: torch.Tensor, probs: torch.Tensor, k: int,
                        sum_over_sequence: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """The Switch/GShard balance term E * sum_i f_i P_i of a micro-batch, as a sum over its n
    tokens (`counts`: assignments per expert, `probs`: (n, E) router probabilities; f_i the
    fraction of the n * k assignments that chose expert i, P_i its mean probability). Under
    context parallel the micro-batch's tokens are spread over the cp ranks: f_i (no gradient)
    comes from the assignments of all of them (`sum_over_sequence`), and each rank adds its own
    tokens' share of n * P_i, so the terms of the cp ranks sum to the whole sequence's."""
    n, e = probs.shape
    if sum_over_sequence is None:
        return e * (counts.float() / (n * k) * probs.mean(0)).sum() * n
    total = sum_over_sequence(torch.cat([counts, counts.new_tensor([n])]))
    return e * (total[:-1].float() / (total[-1].float() * k) * probs.sum(0)).sum()


def _apply_capacity(order: torch.Tensor, assigned: torch.Tensor, counts: torch.Tensor,
                    capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each expert's first `capacity` assignments (in `order`); the kept order and counts."""
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[assigned[order]]
    keep = rank_in_expert < capacity
    return order[keep], counts.clamp(max=capacity)


class CountRouting(torch.autograd.Function):
    """Identity on the router weight; its backward adds the micro-batch's routing figures to
    the step's. So a micro-batch counts exactly when backward reaches the router's weight: a
    training micro-batch once — not the extra forward an activation recompute or a pipeline
    schedule's shape inference runs (inference back-propagates to the stage inputs only), nor
    evaluation."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, module: MoEFeedForward, counts: torch.Tensor,  # type: ignore[override]
                stats: torch.Tensor) -> torch.Tensor:
        ctx.module, ctx.counts, ctx.stats = module, counts, stats
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        with torch.no_grad():
            ctx.module.step_load += ctx.counts
            ctx.module.step_stats += ctx.stats
        return grad, None, None, None


class MoEBlock(TransformerBlock):
    """The GPT block (its forward), with the MoE feed-forward in place of the dense one."""

    def __init__(self, cfg: MoEConfig) -> None:
        nn.Module.__init__(self)  # not TransformerBlock's: it would build a dense feed-forward
        self.attention_norm = RMSNorm(cfg.gpt.d_model, cfg.gpt.norm_eps)
        self.attention = Attention(cfg.gpt)
        self.ffn_norm = RMSNorm(cfg.gpt.d_model, cfg.gpt.norm_eps)
        self.feed_forward = MoEFeedForward(cfg)


class MoEGPT(GPT):
    """The GPT (its forward, parameter counts, plan shape) with MoE blocks."""

    def __init__(self, cfg: MoEConfig) -> None:
        self.moe = cfg  # a plain value, readable by reset_parameters during GPT.__init__
        super().__init__(cfg.gpt, block=lambda: MoEBlock(cfg))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """As the GPT: Normal(0, std), residual output projections (wo, every expert's w2)
        scaled by 1/sqrt(2L); the selection bias starts at 0."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def shape(self) -> ModelShape:
        """The GPT's shape with MoE blocks (`MoEConfig.shape`); `flop_counts` reads it, so FLOPs
        count the active weights: attention, the router, k experts and the shared one."""
        return self.moe.shape(params=self.num_params())

    def shardwise_plan(self) -> ModelPlan:
        """The GPT's plan for attention, norms, embedding and the pipeline cut; the experts of
        each block are `layers.N.feed_forward.experts` (expert parallel shards their dim 0).
        Under tensor parallel the MoE feed-forward is a `tokens` module (whole on every tp
        rank, routing every token of the micro-batch), not split."""
        plan = super().shardwise_plan()
        tp = {p: s for p, s in plan.tp.items() if ".feed_forward." not in p}
        tp["layers.*.feed_forward"] = "tokens"
        return dataclasses.replace(plan, tp=tp, experts="layers.*.feed_forward.experts")


def build_moe_gpt(model: MoeGptFields, vocab_size: int, seq_len: int) -> MoEGPT:
    return MoEGPT(MoEConfig.from_fields(model, vocab_size=vocab_size, seq_len=seq_len))


def _apply_capacity_over_sequence(order: torch.Tensor, assigned: torch.Tensor, k: int, e: int,
                                  capacity: int, split: WholeSequence, rows: int,
                                  local_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_apply_capacity` when context parallel holds each sequence on several ranks: an
    assignment's place in its expert's queue is counted over the whole micro-batch (token order
    of the full sequences, then the k slots), from every cp rank's assignments (gathered: indices
    only), so each rank keeps exactly the assignments the single process keeps. `capacity` is
    the whole micro-batch's."""
    slots = torch.arange(k, device=assigned.device)
    key = (split.token_index(rows, local_len, assigned.device).unsqueeze(1) * k
           + slots).reshape(-1)  # each assignment's number in the whole micro-batch
    keys, experts = split.gather(key).reshape(-1), split.gather(assigned).reshape(-1)
    by_expert = (experts * keys.numel() + keys).argsort()  # keys < numel: no host read
    counts = torch.bincount(experts, minlength=e)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(by_expert)
    place[by_expert] = torch.arange(by_expert.numel(), device=place.device) \
        - starts[experts[by_expert]]
    mine = place.view(split.size, -1)[split.rank]  # this rank's, in `assigned` order
    kept = order[mine[order] < capacity]
    return kept, torch.bincount(assigned[kept], minlength=e)
