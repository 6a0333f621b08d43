"""Which launch attempt this is, agreed by every node of a job.

torchrun's `TORCHELASTIC_RESTART_COUNT` is each node's own count: when one node's worker dies,
that agent counts a restart, but the other nodes' agents restart their workers for the new
rendezvous round without counting (a membership change). The nodes of one round then disagree
on the attempt — measured with two agents on 127.0.0.1: one worker started attempt 1 and its
peer attempt 0, so they joined different store prefixes, one resumed while the other started
afresh, and a fault meant for attempt 0 fired again.

Every round starts every rank exactly once, so a per-rank counter in the launcher's store (which
outlives the workers) counts rounds alike on every rank: attempt = that count - 1. Workers started
by a launcher record it in $SHARDWISE_ATTEMPT; everything else reads `launch_attempt()`.
"""

from __future__ import annotations

import os
from typing import Any

ATTEMPT_ENV = "SHARDWISE_ATTEMPT"


def count_start(store: Any, rank: int) -> int:
    """Count this rank's start in the launcher's store; the job-wide attempt (0 first)."""
    attempt = int(store.add(f"/shardwise/starts/rank_{rank}", 1)) - 1
    os.environ[ATTEMPT_ENV] = str(attempt)
    return attempt


def launch_attempt() -> int:
    """0 for the first start, N after the launcher restarted the workers N times."""
    value = os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(value)
