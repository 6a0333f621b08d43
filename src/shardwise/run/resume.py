"""The one rule that decides whether a launch starts fresh or continues from a checkpoint.

Every way a run starts — `shardwise train`, `train --resume`, the elastic agent restarting the
workers, torchrun (with or without `--max-restarts`), tests — asks `resume_mode` and hands the
answer to `Trainer.start`, which alone acts on it:

- `--resume RUN_DIR` (asked for explicitly): a valid checkpoint must exist; none is a user error.
- a restart (the launcher restarted the workers, attempt > 0): continue from the newest valid
  checkpoint; when the failure came before the first checkpoint, train again from step 0 in the
  same run directory (the ledger and metrics record the new launch), never fail over it.
- otherwise: a fresh run.
"""

from __future__ import annotations

from enum import Enum

from shardwise.resilience.attempt import launch_attempt


class ResumeMode(Enum):
    FRESH = "fresh"
    REQUIRED = "required"  # --resume: a checkpoint must exist
    IF_ANY = "if-any"  # a restart: the newest valid checkpoint if there is one, else step 0


def restart_attempt() -> int:
    """0 for the first start, N after the launcher restarted the workers N times (agreed by
    every node: see shardwise.resilience.attempt)."""
    return launch_attempt()


def resume_mode(requested: bool, attempt: int | None = None) -> ResumeMode:
    attempt = restart_attempt() if attempt is None else attempt
    if requested:
        return ResumeMode.REQUIRED
    return ResumeMode.IF_ANY if attempt > 0 else ResumeMode.FRESH
