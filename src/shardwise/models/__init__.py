"""Model families. Models declare their sharding plan and know nothing of meshes."""

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.registry import build_deferred, build_model

__all__ = ["GPT", "GPTConfig", "build_deferred", "build_model"]
