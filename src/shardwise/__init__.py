"""shardwise: distributed training on PyTorch whose results do not change when the layout changes."""

import time as _time

__version__ = "0.1.0"

#: When this process imported shardwise (before torch): the start of a worker, from which the
#: time to the first step after an elastic restart is measured.
STARTED_AT = _time.time()


def train(*args, **kwargs):
    """Train a run from Python; see `shardwise.api.train`."""
    from shardwise.api import train as _train

    return _train(*args, **kwargs)
