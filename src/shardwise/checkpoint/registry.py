"""Named checkpoints: ROOT/registry.json, next to the checkpoints it names.

The file lives in the checkpoint location (RUN_DIR/checkpoints, or the S3 prefix of
`checkpoint.uri`), not in the run directory, so that whatever prunes a location — the run's own
retention (`Checkpointer._prune`) and `shardwise gc`, which may be given only an s3:// prefix —
reads the protection where it deletes. An entry names a checkpoint by its path under ROOT
(`step-000500`, or `abandoned/branch-.../step-000500` once a branch left it behind) and pins it by
the SHA-256 of its meta.json, so a later checkpoint of the same step (after a branch) is never
mistaken for the registered one. Writing the file is one atomic write (a rename on disk, one PUT
on object storage). Torch-free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import REGISTRY
from shardwise.checkpoint.location import Location
from shardwise.errors import UserError

FORMAT = 1
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class Entry:
    """One registered checkpoint, as the file stores it (`record` holds the manifest summary,
    the evaluation results, who registered it and when, and the MLflow version if any)."""

    name: str
    checkpoint: str  # the path under ROOT: step-000500, or abandoned/.../step-000500
    step: int
    meta_sha256: str
    record: dict[str, Any]

    @property
    def current(self) -> bool:
        """On the run's current line (a top-level step directory), not on an abandoned one."""
        return "/" not in self.checkpoint

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checkpoint": self.checkpoint, "step": self.step,
                "meta_sha256": self.meta_sha256, **self.record}


def check_name(name: str) -> str:
    """A registry name: starts with a letter (so `--from 300` is a step and `--from best` a
    name), then letters, digits, `.`, `_`, `-`."""
    if not _NAME.match(name):
        raise UserError(
            f"--name {name!r} is not a usable registry name: it must start with a letter and "
            "hold only letters, digits, '.', '_' and '-' (at most 100), so that it can never be "
            "read as a step number. For example --name best-val or --name release-1.")
    return name


def read(root: Location) -> list[Entry]:
    """Every entry of ROOT/registry.json ([] when there is none); an unreadable file is an
    error, never an empty registry (that would unprotect every registered checkpoint)."""
    path = root / REGISTRY
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    try:
        data = json.loads(text)
        return [Entry(str(e["name"]), str(e["checkpoint"]), int(e["step"]),
                      str(e["meta_sha256"]),
                      {k: v for k, v in e.items()
                       if k not in ("name", "checkpoint", "step", "meta_sha256")})
                for e in data["entries"]]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"{path} is unreadable ({err}); it names the checkpoints that are registered and "
            "protected from retention. Restore it from a copy, or delete it to unregister "
            "every checkpoint of this location.") from None


def write(root: Location, entries: list[Entry]) -> None:
    text = json.dumps({"format": FORMAT, "entries": [e.to_dict() for e in entries]},
                      indent=2) + "\n"
    path = root / REGISTRY
    if isinstance(path, Path):
        from shardwise.utils.files import atomic_write_text

        root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    else:
        path.write_text(text)  # one PUT: atomic


def protected_steps(root: Location) -> set[int]:
    """The steps of top-level checkpoints that an entry names: retention never deletes them."""
    return {e.step for e in read(root) if e.current}


def protected_paths(root: Location) -> set[str]:
    """Every checkpoint path under ROOT that an entry names (abandoned lines included)."""
    return {e.checkpoint for e in read(root)}


def find(root: Location, name: str) -> Entry | None:
    return next((e for e in read(root) if e.name == name), None)


def add(root: Location, entry: Entry) -> bool:
    """Add `entry`; False when the same name already names the same checkpoint (nothing to
    do); a UserError when the name is taken by another one."""
    entries = read(root)
    for old in entries:
        if old.name != entry.name:
            continue
        if old.checkpoint == entry.checkpoint and old.meta_sha256 == entry.meta_sha256:
            return False
        raise UserError(
            f"the name {entry.name!r} is already registered in {root} for {old.checkpoint} "
            f"(step {old.step}). Choose another --name; names are never moved silently from "
            "one checkpoint to another.")
    write(root, [*entries, entry])
    return True


def remove(root: Location, name: str) -> None:
    write(root, [e for e in read(root) if e.name != name])


def moved(root: Location, renames: dict[str, str]) -> None:
    """Point entries at the new paths of checkpoints a branch moved aside (old -> new path)."""
    entries = read(root)
    if any(e.checkpoint in renames for e in entries):
        write(root, [Entry(e.name, renames.get(e.checkpoint, e.checkpoint), e.step,
                           e.meta_sha256, e.record) for e in entries])

