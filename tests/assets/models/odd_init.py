"""Builders whose init does what real models do, for the meta-device build
(tests/distributed/test_meta_init.py): views and in-place ops on slices, torch.nn.init's
trunc_normal_ (a rejection sampler that reads values), orthogonal_ (a QR), sparse_, an explicit
generator, a value read with `.item()`, tensor literals, a CPU tensor copied in, and non-persistent
buffers. No plan: data parallel only.

`build_off_meta` and `build_tensor_attribute` cannot be built on the meta device faithfully (a
buffer moved to the CPU; a tensor kept outside parameters and buffers): the eager build is used.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class OddInit(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, 2 * width)
        self.gate = nn.Parameter(torch.empty(2 * width, width))
        self.mix = nn.Parameter(torch.zeros(width, width))
        self.out = nn.Linear(width, vocab)
        self.scale = nn.Parameter(torch.ones(width))
        with torch.no_grad():
            nn.init.trunc_normal_(self.embed.weight, std=0.5, a=-1.0, b=1.0)  # rejections
            nn.init.orthogonal_(self.gate)
            nn.init.orthogonal_(self.proj.weight[:, : width // 2])  # a strided view
            self.mix[:, : width // 2].normal_(0.0, 0.1)
            self.mix.t()[1::2].uniform_(-0.2, 0.2)  # every other column, through a transpose
            self.mix[0].fill_(0.5)
            self.mix[1:3].add_(self.mix[3:5])  # reads another slice of the same storage
            self.mix.diagonal().mul_(2.0)
            peak = self.mix.abs().max().item()  # a value read: the eager build's number
            self.mix.div_(peak)
            g = torch.Generator().manual_seed(11)
            self.out.weight.normal_(0.0, 0.02, generator=g)
            nn.init.sparse_(self.out.weight[:, :4], sparsity=0.5)
            self.scale.copy_(torch.linspace(0.5, 1.5, width, device="cpu"))  # a CPU tensor
            if self.proj.bias.sum() > 0:  # control flow on a value
                self.proj.bias.neg_()
        self.register_buffer("mask", torch.tril(torch.ones(width, width)), persistent=False)
        self.register_buffer("table", torch.tensor([1.0, math.pi, 2.5]), persistent=False)
        freqs = torch.arange(width, dtype=torch.float64).div(width).exp()
        self.register_buffer("freqs", freqs.float())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * self.scale
        h = h + torch.tanh(self.proj(h)) @ self.gate * 0.1
        return self.out(h @ (self.mix * self.mask) + self.freqs * self.table[0])


def build(args: dict, vocab_size: int) -> nn.Module:
    return OddInit(vocab_size, args.get("width", 16))


def build_off_meta(args: dict, vocab_size: int) -> nn.Module:
    model = OddInit(vocab_size, args.get("width", 16))
    model.register_buffer("moved", torch.arange(4.0).to("cpu"))  # off the meta device
    return model


def build_tensor_attribute(args: dict, vocab_size: int) -> nn.Module:
    model = OddInit(vocab_size, args.get("width", 16))
    model.plain = torch.ones(3)  # neither a parameter nor a buffer: to_empty would not move it
    return model
