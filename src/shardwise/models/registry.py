"""Build a model from the spec's family name."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.spec.runspec import ModelSection


def build_model(model: ModelSection, vocab_size: int, seq_len: int, seed: int) -> nn.Module:
    """The full model, initialised from `seed` alone so every rank starts from the same weights."""
    if model.family != "gpt":  # the spec validates the family; this guards new families
        raise ValueError(f"unknown model family {model.family!r}")
    cfg = GPTConfig.from_spec(model, vocab_size=vocab_size, seq_len=seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
