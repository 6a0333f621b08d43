"""The checkpoint layout: every name a checkpoint's files and directories have, in one place.

ROOT (RUN_DIR/checkpoints, or the prefix that ROOT/location.json names) holds one directory per
saved step, `step-NNNNNN` (six digits or more, so names sort numerically only when read through
`step_of`). A step directory counts only once its `meta.json` (per-file sizes and SHA-256) is in it:

    step-000120/                  a committed checkpoint
        .metadata, __R_0.distcp   the DCP shards
        rng/rank-00000.pt         each rank's RNG state
        manifest.json             the run manifest at that step
        meta.json                 written last: the commit
    step-000140.staging/          a save in progress, or one a crash interrupted (never loaded)
    step-000120.replaced/         the old step-120 while a re-save swaps in the new one (disk only)
    location.json                 where the checkpoints are when not here (an S3 prefix)
    owner.json                    the run this location belongs to (written by its first save)
    .lock / lock.json             held by the launch saving here (flock on disk; a lease on S3)
    registry.json                 the checkpoints registered by name (kept by every retention)
    abandoned/branch-.../step-N/  a line left behind by `train --resume --from` (never loaded)

Torch-free: the CLI and the planner read these names without importing torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol, TypeVar

META = "meta.json"
LOCATION_FILE = "location.json"  # in RUN_DIR/checkpoints when the checkpoints live elsewhere
OWNER = "owner.json"  # ROOT/owner.json: the run the location belongs to (checkpoint.ownership)
LOCK = ".lock"  # ROOT/.lock: flock'd by the launch that saves there (disk)
LEASE = "lock.json"  # ROOT/lock.json: the same, as a renewed lease (object storage)
STAGING = ".staging"  # suffix of a save that is not committed yet
REPLACED = ".replaced"  # the old step-N while a re-save without renameat2 swaps in the new one
REGISTRY = "registry.json"  # ROOT/registry.json: named checkpoints (checkpoint.registry)
ABANDONED = "abandoned"  # ROOT/abandoned/: checkpoints newer than a branch point, moved aside
RNG_DIR = "rng"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


class _Named(Protocol):
    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=_Named)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(location: _Named) -> int | None:
    """The step a `step-NNNNNN` directory holds; None for any other name (staging included)."""
    match = STEP_DIR.match(location.name)
    return int(match.group(1)) if match else None


def newest_first(locations: Iterable[N]) -> list[N]:
    """The step directories among `locations`, newest step first (by number, not by name)."""
    steps = [(step, loc) for loc in locations if (step := step_of(loc)) is not None]
    return [loc for _, loc in sorted(steps, key=lambda pair: pair[0], reverse=True)]


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank-{rank:05d}.pt"
