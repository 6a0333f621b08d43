"""Activation checkpointing and per-block compilation: compute traded for memory or speed."""

from __future__ import annotations

from torch import nn

from shardwise.spec.runspec import MemorySection


def blocks_of(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else []


def apply_activation_checkpointing(model: nn.Module, memory: MemorySection) -> int:
    """Mark blocks to recompute activations in backward; returns how many were marked.

    `full` marks every block; `selective` every `ac_every`-th (by global layer index, so a
    pipeline stage marks the same layers the whole model would).
    """
    marked = 0
    for name, block in getattr(model, "layers", {}).items():
        on = memory.activation_checkpoint == "full" or (
            memory.activation_checkpoint == "selective" and int(name) % memory.ac_every == 0)
        block.activation_checkpoint = on
        marked += on
    return marked


def apply_compile(model: nn.Module) -> None:
    """torch.compile each block in place (parameter names stay the same)."""
    for block in blocks_of(model):
        block.compile()
