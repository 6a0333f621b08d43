"""Checkpoint integrity: per-file SHA-256 and sizes in meta.json, checked before a load.

Hashing is split across ranks (file i to rank i mod world) both when a checkpoint is written and
when it is verified, so a large checkpoint costs each rank only its share. A checkpoint whose
files do not match — truncated, bit-flipped, missing — is reported by file, and the loader falls
back to the newest checkpoint that does match. This detects corruption, not tampering: whoever can
change a shard can rewrite meta.json too, and loading a checkpoint unpickles its metadata, so a
checkpoint is trusted like code (docs/security.md). Directories are `Location`s (a local path or an
object-store prefix, see `shardwise.checkpoint.location`); listing and reading go through it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint.layout import META
from shardwise.checkpoint.location import Location, list_files
from shardwise.utils.files import sha256_file

__all__ = ["META", "Verdict", "checkpoint_files", "hash_files", "sha256_file", "sizes_match", "verify"]




def checkpoint_files(directory: Location) -> list[str]:
    """Every file of a checkpoint except meta.json itself, as sorted relative paths."""
    return sorted(list_files(directory))


def _share(items: list[str], rank: int, world: int) -> list[str]:
    return [item for i, item in enumerate(items) if i % world == rank]


def _gather(local: dict[str, Any], distributed: bool, group: dist.ProcessGroup | None = None
            ) -> dict[str, Any]:
    if not distributed:
        return local
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def hash_files(directory: Location, rank: int, world: int, distributed: bool,
               group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """{relative path: {size, sha256}} for every file, each rank hashing its share (collective
    over `group`, the default group when None)."""
    sizes = list_files(directory)
    local = {name: {"size": sizes[name], "sha256": sha256_file(directory / name)}
             for name in _share(sorted(sizes), rank, world)}
    return _gather(local, distributed, group)


@dataclass(frozen=True)
class Verdict:
    path: Location
    problems: tuple[str, ...]

    @property
    def valid(self) -> bool:
        return not self.problems


def verify(directory: Location, rank: int, world: int, distributed: bool,
           group: dist.ProcessGroup | None = None) -> Verdict:
    """Check every file listed in meta.json (collective over `group` when distributed)."""
    meta_path = directory / META
    try:
        expected = json.loads(meta_path.read_text())["files"]
    except FileNotFoundError:
        return Verdict(directory, (f"{META} is missing (an interrupted save)",))
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
        return Verdict(directory, (f"{META} is unreadable ({err})",))
    names = sorted(expected)
    present = list_files(directory)
    local: dict[str, str] = {}
    for name in _share(names, rank, world):
        want = expected[name]
        if name not in present:
            local[name] = "is missing"
        elif present[name] != want["size"]:
            local[name] = (f"has {present[name]} bytes, expected {want['size']} "
                           "(truncated or overwritten)")
        elif sha256_file(directory / name) != want["sha256"]:
            local[name] = "has the wrong SHA-256 (its bytes changed after the save)"
    problems = _gather(local, distributed, group)
    return Verdict(directory, tuple(f"{name} {problems[name]}" for name in sorted(problems)))


def sizes_match(directory: Location) -> bool:
    """The cheap check (no hashing): meta.json readable and every listed file has its size."""
    try:
        expected = json.loads((directory / META).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, UnicodeDecodeError):
        return False
    present = list_files(directory)
    return all(present.get(n) == w["size"] for n, w in expected.items())
