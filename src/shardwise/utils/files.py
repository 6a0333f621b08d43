"""File writes that are never seen half-done (write to a temporary name, fsync, rename), and
file hashes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any


def atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` then rename tmp over `path`, so readers see the old file or the new one.
    The file gets the mode every file shardwise writes gets: 0o666 less the umask, like the
    checkpoint shards beside it (`tempfile.mkstemp` would make it 0600, unreadable to the
    other users of a shared run directory or cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_beside(path)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _create_beside(path: Path) -> str:
    """A new empty file with a unique hidden name in `path`'s folder, created with mode 0o666
    (the kernel applies the umask)."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return str(tmp)


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


def cached_sha256(path: Path, cache: Path | None,
                  opener: Callable[[Path], IO[bytes]] = lambda p: p.open("rb")) -> str:
    """SHA-256 of what `opener` reads from `path` (the file's bytes by default), streamed, and
    remembered in `cache` (a JSON file) by (path, size, mtime), so a large unchanged file is read
    once however many ranks, restarts and runs ask. The content alone decides the value."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    known: dict[str, str] = {}
    if cache is not None and cache.exists():
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}  # a damaged cache only costs a recomputation
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with opener(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    known[key] = h.hexdigest()
    if cache is not None:
        with contextlib.suppress(OSError):  # the hash cache is an optimisation only
            atomic_write_text(cache, json.dumps(known))
    return known[key]


@contextlib.contextmanager
def node_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` among the processes of this machine (and of every machine
    sharing the filesystem, where it honours flock): the first to hold it builds what the others
    then read, with no collective and no timeout involved."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
