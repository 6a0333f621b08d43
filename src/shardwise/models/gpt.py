"""A clean decoder-only GPT: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

The model knows nothing of meshes. It declares its plan (`shardwise_plan()`, see
`shardwise.models.plan`) like any user model: the blocks, which modules tensor parallel splits
and how, and the pipeline cut — so `shardwise.parallel` applies any layout without naming any of
its modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.plan import ModelPlan, Stages
from shardwise.shape import ModelShape
from shardwise.spec.model import GptFields
from shardwise.telemetry.flops import FlopCounts


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    @classmethod
    def from_fields(cls, model: GptFields, vocab_size: int, seq_len: int) -> GPTConfig:
        """The spec's [model] fields plus what the data decides (vocabulary, context)."""
        return cls(vocab_size, seq_len, model.n_layers, model.d_model, model.n_heads,
                   model.n_kv_heads, model.ffn_width, model.tie_embeddings, model.rope_theta,
                   model.norm_eps, model.init_std)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def shape(self, params: int) -> ModelShape:
        """This config as the shape vocabulary (`shardwise.shape`), with the model's parameter
        count (which depends on what is built: a pipeline stage holds some blocks only)."""
        return ModelShape(params=params, layers=self.n_layers, hidden=self.d_model,
                          heads=self.n_heads, kv_heads=self.n_kv_heads, ffn=self.ffn_hidden,
                          vocab=self.vocab_size, seq_len=self.seq_len)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim/2), computed in float64 then cast, so every
    rank and every layout gets the same bits."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x (batch, heads, seq, head_dim) by position."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.attention_fn = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 instead of the head count, so a tensor-parallel shard with fewer heads also works.
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attention_fn(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The attention core (the plan's `attention_fn`, which context parallel swaps): causal
    SDPA of q (B, H, T, D) against k/v (B, H_kv, T, D), each K/V head shared by H/H_kv heads."""
    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each KV head
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, block: Callable[[], nn.Module] | None = None) -> None:
        """`block`: builds one block (default the dense TransformerBlock; the MoE GPT passes
        its MoE block), so every GPT variant shares this construction order and init."""
        super().__init__()
        self.cfg = cfg
        make_block = block or (lambda: TransformerBlock(cfg))
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # A ModuleDict keyed "0".."L-1" keeps names stable when a pipeline stage drops layers.
        self.layers = nn.ModuleDict({str(i): make_block() for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, std) weights; residual output projections scaled by 1/sqrt(2L) (GPT-2)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq).

        `positions` (int64, (seq,)): the true positions of the tokens when they are not 0..seq-1
        (context parallel gives each rank non-contiguous chunks); the rotary angles follow them.
        A pipeline stage is this model with some parts removed (set to None): without
        `tok_embeddings` it takes hidden states, without `output` it returns them.
        """
        if tokens.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds the model's "
                             f"seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos, self.rope_sin
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x

    # --- facts the rest of shardwise asks the model for -------------------------------------
    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied embedding counts once)."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if exclude_embeddings and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total

    def shape(self) -> ModelShape:
        """The model's shape: its config's, with the parameters this module holds."""
        return self.cfg.shape(params=self.num_params())

    def flop_counts(self) -> FlopCounts:
        """The facts `shardwise.telemetry.flops` computes FLOPs from (its docstring has the
        definition), from the shape. The layers, widths and vocabulary are the full model's
        config, so every pipeline stage reports the same."""
        return FlopCounts.of(self.shape())

    def flops_per_token(self, causal_halved: bool = False) -> float:
        """Training FLOPs per token: 6·N_matmul + 12·L·H·Q·T (PaLM appendix B).

        N_matmul counts the weights used in matrix multiplies (all but the embedding lookup and the
        norms; the output projection counts even when tied). By default the attention term counts
        QK^T and AV over the full T×T square, forward and backward, without halving for the causal
        mask (what torch's flop counter counts); MFU uses `causal_halved=True`.
        """
        return self.flop_counts().per_token(causal_halved)

    def shardwise_plan(self) -> ModelPlan:
        """Blocks `layers.N`; Megatron's split of attention (q/k/v by heads, o by its input) and
        of the SwiGLU MLP; vocabulary-parallel embedding and output; the norms between blocks
        sequence-parallel; a pipeline stage is cut between blocks (embedding first, final norm
        and output last)."""
        shape = self.shape()
        return ModelPlan(
            shape=shape,
            blocks="layers",
            tp={"tok_embeddings": "embedding",
                "layers.*.attention_norm": "sequence",
                "layers.*.attention": "full_input",
                "layers.*.attention.wq": "colwise",
                "layers.*.attention.wk": "colwise",
                "layers.*.attention.wv": "colwise",
                "layers.*.attention.wo": "rowwise",
                "layers.*.ffn_norm": "sequence",
                "layers.*.feed_forward.w1": "colwise",
                "layers.*.feed_forward.w3": "colwise",
                "layers.*.feed_forward.w2": "rowwise",
                "norm": "sequence",
                "output": "output"},
            stages=Stages(first=("tok_embeddings",), last=("norm", "output")),
            attention="layers.*.attention",
            positions="positions",
            flop_counts=FlopCounts.of(shape),
        )
