"""Activation checkpointing and per-block compilation: compute traded for memory or speed.

Both work on the blocks the model's plan names. Activation checkpointing replaces a block's
`forward` on the instance (a wrapper module would rename every parameter, and with them every
checkpoint key), so FSDP's hooks, compile and state dicts see the same module as before.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardwise.models.plan import ModelPlan
from shardwise.spec.layout import MemorySection


def blocks_of(model: nn.Module, plan: ModelPlan) -> list[tuple[str, nn.Module]]:
    """(name within the container, block) for the blocks this model (or pipeline stage) holds;
    names are the whole model's ("0".."L-1"), also on a stage that holds only some."""
    if not plan.blocks:
        return []
    container = model.get_submodule(plan.blocks)
    return [(name, block) for name, block in container._modules.items() if block is not None]


def apply_activation_checkpointing(model: nn.Module, plan: ModelPlan,
                                   memory: MemorySection) -> int:
    """Recompute blocks' activations in backward; returns how many blocks were wrapped.

    `full` wraps every block; `selective` every `ac_every`-th (by its position in the whole
    model, so a pipeline stage wraps the same blocks the whole model would).
    """
    wrapped = 0
    for position, (name, block) in enumerate(blocks_of(model, plan)):
        index = int(name) if name.isdigit() else position
        on = memory.activation_checkpoint == "full" or (
            memory.activation_checkpoint == "selective" and index % memory.ac_every == 0)
        if on:
            _checkpointed(block)
            wrapped += 1
    return wrapped


def _checkpointed(block: nn.Module) -> None:
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)
        return inner(*args, **kwargs)

    block.forward = forward


def apply_compile(model: nn.Module, plan: ModelPlan) -> None:
    """torch.compile each block in place (parameter names stay the same)."""
    for _name, block in blocks_of(model, plan):
        block.compile()
