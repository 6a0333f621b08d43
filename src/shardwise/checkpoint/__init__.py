"""Sharded checkpoints: save/load of Stateful components, staged and renamed when complete."""

from shardwise.checkpoint.checkpointer import Checkpointer, ModelState

__all__ = ["Checkpointer", "ModelState"]
