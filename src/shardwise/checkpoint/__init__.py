"""Sharded checkpoints: save/load of Stateful components (synchronous or async), verified and
committed atomically, on local disk or S3-compatible storage."""

from shardwise.checkpoint.checkpointer import Checkpointer, SaveRecord
from shardwise.checkpoint.state import ModelState

__all__ = ["Checkpointer", "ModelState", "SaveRecord"]
