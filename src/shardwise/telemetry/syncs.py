"""Counting host synchronisations on a GPU (opt-in: SHARDWISE_SYNC_DEBUG=1).

torch can warn at every operation that makes the host wait for the device
(`torch.cuda.set_sync_debug_mode("warn")`); this turns those warnings into a count per training
step, reported as `host_syncs_per_step` in the step event. shardwise's step makes one (whether
the global gradient norm is finite); anything more is a regression. Off by default: the check
itself costs a Python warning per sync. CPUs have no such syncs; nothing is counted there.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

_MESSAGE = "called a synchronizing CUDA operation"


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("SHARDWISE_SYNC_DEBUG", "") == "1"


@contextlib.contextmanager
def counting(device: torch.device) -> Iterator[list[int]]:
    """Yields a one-element list that holds the number of syncs once the block ends."""
    count = [0]
    if not enabled(device):
        yield count
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    count[0] = sum(_MESSAGE in str(w.message) for w in caught)
