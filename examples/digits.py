"""Not a language model: a small convolutional network on scikit-learn's handwritten digits.

    pip install scikit-learn                          # (or: pip install -e ".[examples]")
    shardwise train examples/digits.toml              # from the repository root: ZeRO-3 over 2

Two functions, each named by the spec:
- `load(args)` is the dataset (`data.source = "py:examples/digits.py:load"`): the 1,797 8x8
  images that ship inside scikit-learn (no download), split once by a fixed permutation into
  training and held-out samples, returned as a `shardwise.data.SampleData` of (image, label)
  pairs. shardwise's global-index sampler, sample ledger and resume handle them like text.
- `build(args, num_classes)` is the model (`model.family = "py:examples/digits.py:build"`): its
  plan names the residual blocks, the unit ZeRO-3 shards and gathers one at a time. No tensor or
  pipeline plan: it trains under every data-parallel layout, and tp/pp are refused.

The loss is shardwise's cross entropy over the classes, summed over samples and divided by the
step's global sample count; the held-out evaluation reports accuracy beside the loss and the
class-prior baseline (chance is 10%).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.data import SampleData
from shardwise.models.plan import ModelPlan, ModelShape


def load(args: dict) -> SampleData:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(
        int(args.get("split_seed", 0))))
    n_val = int(len(labels) * float(args.get("val_fraction", 0.2)))
    pairs = [(images[i], labels[i]) for i in order.tolist()]
    return SampleData(train=pairs[n_val:], val=pairs[:n_val], num_classes=10)


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(4, width)  # no batch statistics: the same at every layout
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.gelu(self.conv1(self.norm(x))))


class DigitNet(nn.Module):
    def __init__(self, num_classes: int, width: int, depth: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        self.shape = ModelShape(params=sum(p.numel() for p in self.parameters()), layers=depth,
                                hidden=width)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.stem(images))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # (batch, classes)

    def shardwise_plan(self) -> ModelPlan:
        return ModelPlan(shape=self.shape, blocks="blocks")


def build(args: dict, num_classes: int) -> nn.Module:
    return DigitNet(num_classes, int(args.get("width", 32)), int(args.get("depth", 3)))
