"""Finding a run's checkpoints: the one implementation that resume, export, status and verify use.

The rule everywhere: a `step-N` directory (see `layout`) counts only if its meta.json exists and
every file it lists matches it. `newest_complete` checks sizes only (cheap: the CLI before any
worker starts, `status`); `newest_valid` hashes every file (what is about to be loaded; inside a
run collectively, each rank hashing its share, through `Checkpointer.find_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint.integrity import Verdict, sizes_match, verify
from shardwise.checkpoint.layout import META, STAGING, newest_first
from shardwise.checkpoint.location import Location
from shardwise.checkpoint.storage import LocalStorage, Storage, follow_location
from shardwise.errors import UserError


def candidates(storage: Storage[Any]) -> list[Location]:
    """Every step directory, newest step first (complete or not)."""
    return newest_first(storage.step_dirs())


def uncommitted(storage: Storage[Any]) -> list[Location]:
    """Saves that were started and never committed: `step-N.staging` on disk, a `step-N` prefix
    without meta.json on object storage (where a save writes in place)."""
    root = storage.root
    if not isinstance(root, Path):
        return sorted(p for p in storage.step_dirs() if not (p / META).exists())
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"step-*{STAGING}") if p.is_dir())


def newest_complete(storage: Storage[Any]) -> Location | None:
    """The newest checkpoint whose meta.json lists files of the right sizes (no hashing). Puts
    back a step a crash left half-replaced first, so call it from one process (rank 0)."""
    storage.recover()
    return next((p for p in candidates(storage) if sizes_match(p)), None)


def newest_valid(storage: Storage[Any], rank: int = 0, world: int = 1, distributed: bool = False,
                 group: dist.ProcessGroup | None = None) -> tuple[Location | None, list[Verdict]]:
    """The newest checkpoint whose every file matches its size and SHA-256, and the verdicts of
    the newer ones that did not. Collective over `group` when `distributed` (each rank hashes its
    share); the caller runs `storage.recover()` first, on one rank, before every rank lists."""
    rejected: list[Verdict] = []
    for path in candidates(storage):
        verdict = verify(path, rank, world, distributed, group)
        if verdict.valid:
            return path, rejected
        rejected.append(verdict)
    return None, rejected


def run_checkpoints(run_dir: Path) -> Storage[Any]:
    """The storage of a run directory's checkpoints (RUN_DIR/checkpoints, or where its
    location.json points)."""
    return follow_location(run_dir / "checkpoints")


@dataclass(frozen=True)
class Found:
    """A checkpoint, the storage that reads it, and the run directory it belongs to."""

    location: Location
    storage: Storage[Any]
    run_dir: Path

    @property
    def name(self) -> str:
        return self.location.name

    def reader(self) -> Any:
        """A DCP reader of the checkpoint (local files or the bucket's objects)."""
        return self.storage.reader(self.location)


def checkpoint_at(path: Path) -> Found:
    """`path` itself when it is a checkpoint, or a run directory's newest checkpoint that verifies
    (wherever the run keeps them: RUN_DIR/checkpoints or the bucket its location.json names)."""
    if (path / META).is_file():
        return Found(path, LocalStorage(path.parent), path.parent.parent)
    if not (path / "checkpoints").is_dir():
        raise UserError(f"{path} is neither a checkpoint (no {META} in it) nor a run directory "
                        "(no checkpoints/ in it). Pass runs/NAME or runs/NAME/checkpoints/step-N.")
    storage = run_checkpoints(path)
    storage.recover()
    found, rejected = newest_valid(storage)
    if found is None:
        why = "".join(f"; {v.path}: {'; '.join(v.problems)}" for v in rejected[:3])
        raise UserError(f"{path} has no checkpoint that verifies (in {storage.root}{why}). Train "
                        "with checkpoint.enabled = true, or pass a checkpoint directory.")
    return Found(found, storage, path)
