"""One optimizer step: forward/backward over this rank's micro-batches, clip, update.

Loss normalisation: each micro-batch contributes (sum of its token losses) / (global target tokens
of the step), so micro-batching and sharding never change the objective; the data-parallel mean
of gradients is turned back into a sum by `dp_loss_scale`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.data.loader import Batch
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.parallelize import dp_loss_scale, grad_sync
from shardwise.run.optim import clip_grad_norm, set_lr


@dataclass(frozen=True)
class StepResult:
    step: int  # 1-based number of the step just completed
    loss: float  # global mean token loss of the step
    grad_norm: float  # global norm before clipping
    lr: float
    tokens: int  # global target tokens of the step


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss_sum(model: nn.Module, batch: Batch, precision: str,
                   device: torch.device) -> torch.Tensor:
    inputs, targets = batch
    with autocast(precision, device):
        logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch],
               global_tokens: int, *, step: int, lr: float, grad_clip: float, precision: str,
               ctx: DistContext) -> StepResult:
    model.train()
    set_lr(optimizer, lr)
    scale = dp_loss_scale(ctx) / global_tokens
    local_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for i, batch in enumerate(batches):
        with grad_sync(model, enabled=i == len(batches) - 1):
            loss_sum = token_loss_sum(model, batch, precision, ctx.device)
            (loss_sum * scale).backward()
        local_sum += loss_sum.detach().double()
    grad_norm = clip_grad_norm(model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ctx.distributed:
        dist.all_reduce(local_sum, group=ctx.dp_group())
    return StepResult(step + 1, float(local_sum) / global_tokens, grad_norm, lr, global_tokens)


@torch.no_grad()
def evaluate(model: nn.Module, batches, num_tokens: int, precision: str,
             ctx: DistContext) -> float:
    """Mean held-out token loss over every rank's share of the evaluation set."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for batch in batches:
        total += token_loss_sum(model, batch, precision, ctx.device).double()
    if ctx.distributed:
        dist.all_reduce(total, group=ctx.dp_group())
    model.train()
    return float(total) / num_tokens
