"""A user dataset of variable-length token sequences, padded per micro-batch, and a user model
whose outputs are a dict and whose plan brings its own loss (cross entropy plus a z-loss, summed
over real targets). Real-target counts differ widely between micro-batches, so any
mean-of-means would change with the layout; shardwise's sum / global count must not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.data import SampleData
from shardwise.models.plan import IGNORE_INDEX, ModelPlan, ModelShape

Z_WEIGHT = 1e-3


def data(args: dict) -> SampleData:
    vocab, n = int(args.get("vocab", 40)), int(args.get("samples", 96))
    g = torch.Generator().manual_seed(int(args.get("seed", 0)))

    def sequence() -> torch.Tensor:  # a learnable rule (next = 3 * current + 1 mod vocab), noised
        length = int(torch.randint(3, int(args.get("max_len", 24)) + 1, (1,), generator=g))
        x = [int(torch.randint(vocab, (1,), generator=g))]
        for _ in range(length):
            noise = int(torch.randint(vocab, (1,), generator=g)) if torch.rand(
                1, generator=g) < 0.1 else None
            x.append(noise if noise is not None else (3 * x[-1] + 1) % vocab)
        return torch.tensor(x)

    samples = [sequence() for _ in range(n)]
    return SampleData(train=samples[: n * 3 // 4], val=samples[n * 3 // 4:], collate=pad,
                      num_classes=vocab)


def pad(samples: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), width, dtype=torch.long)
    targets = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        inputs[i, : len(s) - 1], targets[i, : len(s) - 1] = s[:-1], s[1:]
    return inputs, targets


def loss_sum(outputs: dict, targets: torch.Tensor) -> torch.Tensor:
    logits = outputs["logits"].flatten(0, 1).float()
    flat = targets.flatten()
    real = flat != IGNORE_INDEX
    ce = F.cross_entropy(logits, flat, reduction="sum")
    return ce + Z_WEIGHT * (torch.logsumexp(logits, -1)[real] ** 2).sum()


class RaggedLM(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, vocab)
        self.shape = ModelShape(params=sum(p.numel() for p in self.parameters()), layers=depth,
                                hidden=width, vocab=vocab)

    def forward(self, tokens: torch.Tensor) -> dict:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return {"logits": self.head(x), "width": x.shape[-1]}

    def shardwise_plan(self) -> ModelPlan:
        return ModelPlan(shape=self.shape, blocks="blocks", loss=loss_sum)


def build(args: dict, vocab_size: int) -> nn.Module:
    return RaggedLM(vocab_size, int(args.get("width", 32)), int(args.get("depth", 2)))
