"""shardwise: distributed training on PyTorch whose results do not change when the layout changes."""

from shardwise.meta import STARTED_AT, __version__

__all__ = ["STARTED_AT", "__version__", "train"]


def train(*args, **kwargs):
    """Train a run from Python; see `shardwise.api.train`."""
    from shardwise.api import train as _train

    return _train(*args, **kwargs)
