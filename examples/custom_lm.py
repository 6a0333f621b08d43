"""Bring your own model: a small language model that is not shardwise's GPT, and its plan.

    shardwise train examples/custom_lm.toml          # from the repository root

What shardwise needs from a model is a plain nn.Module plus a `shardwise_plan()` (see
`shardwise.models.plan`): which modules are the repeated blocks, how tensor parallel splits
them, and where a pipeline stage is cut. This one has LayerNorm with biases, causal attention
with biased projections (no key bias: its gradient is zero in exact arithmetic) and no
positional encoding, a GELU MLP in a ModuleDict, blocks in an nn.ModuleList, and optionally tied
input/output embeddings. Its forward skips the modules a pipeline stage does not hold (set to
None), as the plan's contract asks. The tests train it under every layout its plan allows
(tests/distributed/test_model_plan.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.plan import ModelPlan, ModelShape, Stages


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a constant
        # shift of a row's scores), so AdamW would turn rounding noise into full-size steps
        self.q, self.k = nn.Linear(width, width), nn.Linear(width, width, bias=False)
        self.v, self.proj = nn.Linear(width, width), nn.Linear(width, width)
        self.head_dim = width // heads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(width, 3 * width),
                                  "out": nn.Linear(3 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp["out"](F.gelu(self.mlp["fc"](self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int, heads: int, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        # GPT-2's scale: PyTorch's N(0, 1) embedding would start a tied head at logits of std
        # sqrt(width), a loss of ~30 nats instead of log(vocab)
        nn.init.normal_(self.embed.weight, std=0.02)
        if not tied:
            nn.init.normal_(self.head.weight, std=0.02)
        unique = {id(p): p for p in self.parameters()}.values()
        self.shape = ModelShape(params=sum(p.numel() for p in unique), layers=depth,
                                hidden=width, heads=heads, vocab=vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x) if self.head is not None else x

    def shardwise_plan(self) -> ModelPlan:
        return ModelPlan(
            shape=self.shape, blocks="blocks",
            tp={"embed": "embedding", "blocks.*.ln?": "sequence", "blocks.*.attn": "full_input",
                "blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.proj": "rowwise",
                "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.out": "rowwise",
                "ln_f": "sequence", "head": "output"},
            stages=Stages(first=("embed",), last=("ln_f", "head")),
            attention="blocks.*.attn")


def build(args: dict, vocab_size: int) -> nn.Module:
    return TinyLM(vocab_size, args.get("width", 32), args.get("depth", 4), args.get("heads", 4),
                  args.get("tied", False))
