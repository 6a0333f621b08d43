"""Per-rank model-state accounting: bytes of parameters, gradients and optimizer state that this
rank actually holds, measured on real tensors during the first step so the ZeRO formulas can be
checked against them.

- `param_bytes`: parameters at rest (FSDP: the local shards; DDP/ZeRO-1: full copies).
- `gathered_param_bytes`: parameters FSDP holds unsharded when forward ends (ZeRO-2: all of them;
  ZeRO-3: only the last block, which is kept for backward). Peak parameters = the sum of both.
- `grad_bytes`: gradients when the optimizer steps (FSDP: reduce-scattered shards).
- `optimizer_bytes`: optimizer state after the step (moments, step counters, ZeRO-1 master shards).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.parallel.parallelize import ParallelModel, local_bytes


class Optimizers(Protocol):
    """What the meter reads of the run's optimizers (shardwise.run.optim.Optimizers)."""

    optimizers: list[Any]  # torch optimizers, or wrappers of one (`.optimizer`: ZeRO-1)

    def state_tensors(self) -> list: ...


class ModelStateMeter:
    def __init__(self, pm: ParallelModel, optimizers: Optimizers) -> None:
        self.pm, self.optimizers = pm, optimizers
        self.report: dict[str, int] | None = None

    @contextlib.contextmanager
    def measuring(self, first: bool) -> Iterator[None]:
        if not first or self.report is not None:
            yield
            return
        seen = {"gathered": 0, "grads": 0}

        def after_forward(module: nn.Module, args, output) -> None:
            if isinstance(module, FSDPModule):
                gathered = sum(p.numel() * p.element_size() for p in module.parameters()
                               if not isinstance(p, DTensor))
                seen["gathered"] = max(seen["gathered"], gathered)

        def before_step(*_args) -> None:
            seen["grads"] = max(seen["grads"],
                                local_bytes(p.grad for p in self.pm.parameters()))

        handles = [part.register_forward_hook(after_forward) for part in self.pm.parts]
        for o in self.optimizers.optimizers:
            inner = getattr(o, "optimizer", o)
            handles.append(inner.register_step_pre_hook(before_step))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self.report = {
            "param_bytes": local_bytes(self.pm.parameters()),
            "gathered_param_bytes": seen["gathered"],
            "grad_bytes": seen["grads"],
            "optimizer_bytes": local_bytes(self.optimizers.state_tensors()),
        }


def zero_formula_bytes(zero: int, numel: int, n: int, bytes_per: int = 4) -> dict[str, float]:
    """What the ZeRO paper's accounting predicts per rank for fp32 training with AdamW
    (parameter p, gradient g, moments 2p; ZeRO-1 adds an fp32 master shard), N ranks."""
    full = numel * bytes_per
    if zero == 0:
        return {"params": full, "grads": full, "optimizer": 2 * full}
    if zero == 1:
        return {"params": full, "grads": full, "optimizer": 3 * full / n}
    return {"params": full / n, "grads": full / n, "optimizer": 2 * full / n}

