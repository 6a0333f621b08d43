"""Sharded checkpoints: save/load of Stateful components, staged and renamed when complete."""

from shardwise.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer

__all__ = ["Checkpointer", "ModelAndOptimizer"]
