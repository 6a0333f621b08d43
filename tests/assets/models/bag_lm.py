"""A user model with no plan at all: a per-token MLP language model. Data parallel only (DDP,
ZeRO-1/2/3, HSDP); tensor and pipeline parallel are refused before any worker starts."""

from __future__ import annotations

from torch import nn


def build(args: dict, vocab_size: int) -> nn.Module:
    width = args.get("width", 48)
    return nn.Sequential(nn.Embedding(vocab_size, width), nn.Linear(width, 2 * width), nn.GELU(),
                         nn.LayerNorm(2 * width), nn.Linear(2 * width, vocab_size))
