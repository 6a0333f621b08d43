"""Checkpoint integrity: per-file SHA-256 and sizes in meta.json, checked before a load.

Hashing is split across ranks (file i to rank i mod world) both when a checkpoint is written and
when it is verified, so a large checkpoint costs each rank only its share. A checkpoint whose
files do not match — truncated, bit-flipped, missing — is reported by file, and the loader falls
back to the newest checkpoint that does match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

META = "meta.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """Every file of a checkpoint except meta.json itself, as sorted relative paths."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.name != META)


def _share(items: list[str], rank: int, world: int) -> list[str]:
    return [item for i, item in enumerate(items) if i % world == rank]


def _gather(local: dict[str, Any], distributed: bool) -> dict[str, Any]:
    if not distributed:
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged


def hash_files(directory: Path, rank: int, world: int, distributed: bool) -> dict[str, Any]:
    """{relative path: {size, sha256}} for every file, each rank hashing its share (collective)."""
    files = checkpoint_files(directory)
    local = {name: {"size": (directory / name).stat().st_size,
                    "sha256": sha256_file(directory / name)}
             for name in _share(files, rank, world)}
    return _gather(local, distributed)


@dataclass(frozen=True)
class Verdict:
    path: Path
    problems: tuple[str, ...]

    @property
    def valid(self) -> bool:
        return not self.problems


def verify(directory: Path, rank: int, world: int, distributed: bool) -> Verdict:
    """Check every file listed in meta.json (collective when distributed)."""
    meta_path = directory / META
    try:
        expected = json.loads(meta_path.read_text())["files"]
    except FileNotFoundError:
        return Verdict(directory, (f"{META} is missing (an interrupted save)",))
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
        return Verdict(directory, (f"{META} is unreadable ({err})",))
    names = sorted(expected)
    local: dict[str, str] = {}
    for name in _share(names, rank, world):
        path, want = directory / name, expected[name]
        if not path.is_file():
            local[name] = "is missing"
        elif path.stat().st_size != want["size"]:
            local[name] = (f"has {path.stat().st_size} bytes, expected {want['size']} "
                           "(truncated or overwritten)")
        elif sha256_file(path) != want["sha256"]:
            local[name] = "has the wrong SHA-256 (its bytes changed after the save)"
    problems = _gather(local, distributed)
    return Verdict(directory, tuple(f"{name} {problems[name]}" for name in sorted(problems)))


def sizes_match(directory: Path) -> bool:
    """The cheap check (no hashing): meta.json readable and every listed file has its size."""
    try:
        expected = json.loads((directory / META).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, UnicodeDecodeError):
        return False
    return all((directory / n).is_file() and (directory / n).stat().st_size == w["size"]
               for n, w in expected.items())
