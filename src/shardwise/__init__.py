"""shardwise: distributed training on PyTorch whose results do not change when the layout changes."""

__version__ = "0.1.0"
