"""The learning-rate schedule: a pure function of the step, the [optimizer] section and the run's
length, so a resumed run continues it exactly (and a resume that changes its length can say what
that does to the rate). Imports no torch."""

from __future__ import annotations

import math

from shardwise.spec.runspec import OptimizerSection

__all__ = ["lr_at"]


def lr_at(step: int, opt: OptimizerSection, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return opt.lr
    span = max(1, total_steps - opt.warmup_steps)
    progress = min(1.0, (step - opt.warmup_steps) / span)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1.0 + math.cos(math.pi * progress))
