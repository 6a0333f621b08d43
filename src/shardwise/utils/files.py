"""File writes that are never seen half-done (write to a temporary name, fsync, rename), and
file hashes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` then rename tmp over `path`, so readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def sha256_file(path: Any) -> str:
    """SHA-256 of a file (anything with `.open("rb")`: a Path, or a storage location)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root(cache_dir: str = "") -> Path:
    """Where shardwise caches what it can recompute (token arrays, file hashes, the CPU matmul
    probe): `cache_dir` (a run's `data.cache_dir`), else $SHARDWISE_CACHE, else
    ~/.cache/shardwise. One rule, so the planner finds the probe a run cached."""
    return Path(cache_dir or os.environ.get("SHARDWISE_CACHE") or "~/.cache/shardwise").expanduser()
