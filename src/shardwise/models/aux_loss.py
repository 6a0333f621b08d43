"""Auxiliary losses a model adds inside its forward (an MoE router's load-balancing loss), on the
same loss path as the main loss under every layout.

The objective of a step is (sum of per-target losses + sum of auxiliary terms) / (the step's
global count of real targets). A module adds its term with `add_aux_loss(x, aux_sum)`: `x` is
returned unchanged, and backward through it adds the gradient of `aux_sum x scale`, where `scale`
is the factor the trainer multiplies each micro-batch's loss sum by (1 / global targets, times
the fp16 loss scale), set by `aux_loss_scale` around the step's forward and backward. So the
term needs no path of its own to the loss: it works inside pipeline stages (each stage's
backward reaches its own blocks), under activation checkpointing (the node is in the original
graph, not the recompute) and under every data-parallel reduction (a gradient like any other).
`aux_sum` is a *sum* over the micro-batch's tokens (e.g. tokens x the per-token mean loss), so
micro-batching and sharding never change the objective. Without `aux_loss_scale` (a module
called outside shardwise's loop) the scale is 1. Under `torch.no_grad` nothing is added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["add_aux_loss", "aux_loss_scale", "current_aux_scale"]

_SCALE: list[float | torch.Tensor] = [1.0]


@contextlib.contextmanager
def aux_loss_scale(scale: float | torch.Tensor) -> Iterator[None]:
    """Within this context, auxiliary terms are scaled like the main loss (`scale`)."""
    _SCALE.append(scale)
    try:
        yield
    finally:
        _SCALE.pop()


def current_aux_scale() -> float | torch.Tensor:
    return _SCALE[-1]


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on x; d(objective)/d(aux_sum) = the current scale (Megatron's
    MoEAuxLossAutoScaler, with shardwise's normalisation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux_sum: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = current_aux_scale()
        ctx.aux_meta = (aux_sum.dtype, aux_sum.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        dtype, device = ctx.aux_meta
        scale = torch.as_tensor(ctx.scale, dtype=dtype, device=device)
        return grad, scale.reshape(())


def add_aux_loss(x: torch.Tensor, aux_sum: torch.Tensor) -> torch.Tensor:
    """`x`, carrying `aux_sum` (a 0-d sum over the micro-batch's tokens) into the objective."""
    if not (torch.is_grad_enabled() and aux_sum.requires_grad):
        return x
    return _InjectAuxGrad.apply(x, aux_sum)
