"""AdamW, the learning-rate schedule, and gradient clipping on the true global norm.

The schedule is a pure function of the step, so it has no state of its own to checkpoint: resuming
at step k gives lr(k) exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.spec.runspec import OptimizerSection


def build_optimizer(model: nn.Module, opt: OptimizerSection,
                    device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not norms or 1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    impl = opt.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, **kwargs,
    )


def lr_at(step: int, opt: OptimizerSection, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global L2 norm of all gradients (across every shard), clipped to `max_norm` if > 0.

    Under FSDP the gradients are DTensor shards; their norm is a partial value that
    `full_tensor()` reduces across the mesh, so the norm is the true global one.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, total, foreach=True)
    return float(total)
