"""`shardwise gc` over checkpoints: retention across runs, on disk and on S3.

Each argument is a run directory (its checkpoints wherever its location.json points), a directory
of run directories (runs/), a checkpoint location itself (RUN_DIR/checkpoints, a directory of
step-N) or an s3:// prefix (a location, or a prefix whose children are locations). In every
location the rule is the checkpointer's own, with registration on top:

- keep the newest `keep_last` committed checkpoints (at least 1: the one a resume continues from),
  every step that is a multiple of `keep_every`, and every registered one (`checkpoint.registry`);
- delete the other committed checkpoints, the saves a crash interrupted (never loadable), and
  with `drop_abandoned` the lines a branch left behind (registered ones among them are kept).

A location whose launch lock is held (a running launch: `checkpoint.ownership`) is not touched; a
dry run reads the lock without taking it. Otherwise the lock is held while deleting, so no launch
starts saving there meanwhile. Deletions go through the storage (meta.json first, so a half
deleted checkpoint never verifies). Nothing outside the listed locations is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.checkpoint import discovery, ownership, registry
from shardwise.checkpoint.layout import ABANDONED, META, newest_first, step_of
from shardwise.checkpoint.location import Location, RemotePath, StorageSpec, list_files
from shardwise.checkpoint.storage import LocalStorage, Storage, follow_location, open_storage
from shardwise.errors import UserError


@dataclass(frozen=True)
class Policy:
    keep_last: int = 3
    keep_every: int = 0
    drop_abandoned: bool = False

    def check(self) -> Policy:
        if self.keep_last < 1:
            raise UserError(f"--keep-last {self.keep_last}: gc always keeps at least the newest "
                            "checkpoint of a run (where a resume continues). Pass --keep-last 1 "
                            "or more; register a checkpoint to keep it whatever its age.")
        if self.keep_every < 0:
            raise UserError(f"--keep-every {self.keep_every}: pass a step interval (0: none).")
        return self


@dataclass
class Plan:
    """What gc keeps and deletes in one location, and why."""

    label: str
    storage: Storage[Any]
    keep: list[tuple[str, str]] = field(default_factory=list)  # (path under ROOT, why)
    delete: list[tuple[Location, str, int]] = field(default_factory=list)  # (where, why, bytes)
    skipped: str | None = None  # why the location is not touched (a running launch holds it)

    @property
    def bytes(self) -> int:
        return sum(size for _, _, size in self.delete)


def locations(paths: list[str], spec: StorageSpec) -> list[tuple[str, Storage[Any]]]:
    """Every checkpoint location the arguments name (see the module docstring), once each."""
    found: dict[str, tuple[str, Storage[Any]]] = {}
    for text in paths:
        for label, storage in _expand(text, spec):
            found.setdefault(str(storage.root), (label, storage))
    return list(found.values())


def _expand(text: str, spec: StorageSpec) -> list[tuple[str, Storage[Any]]]:
    if text.startswith("s3://"):
        storage = open_storage(StorageSpec(text, spec.endpoint_url, spec.region, spec.profile),
                               Path("."))
        if _is_location(storage.root):
            return [(text, storage)]
        children = [p for p in storage.root.iterdir() if _is_location(p)]
        if not children:
            raise UserError(f"{text} holds no checkpoints (no step-N prefix, no owner.json, "
                            "there or one level below). Pass the prefix a run's checkpoint.uri "
                            "names, or its parent.")
        assert isinstance(storage.root, RemotePath)
        return [(str(p), open_storage(StorageSpec(str(p), spec.endpoint_url, spec.region,
                                                  spec.profile), Path("."))) for p in children]
    path = Path(text).expanduser()
    if (path / "spec.toml").is_file():
        return [(text, follow_location(path / "checkpoints"))]
    if path.is_dir() and _is_location(path):
        return [(text, LocalStorage(path))]
    runs = sorted(p for p in path.iterdir() if (p / "spec.toml").is_file()) \
        if path.is_dir() else []
    if not runs:
        raise UserError(f"{text} is neither a run directory (no spec.toml), a directory of run "
                        "directories, a checkpoint location (no step-N, no owner.json) nor an "
                        "s3:// prefix. Pass runs/NAME, runs/, or s3://BUCKET/PREFIX.")
    return [(str(p), follow_location(p / "checkpoints")) for p in runs]


def _is_location(root: Location) -> bool:
    return (root / "owner.json").exists() or any(step_of(p) is not None for p in root.iterdir())


def plan(label: str, storage: Storage[Any], policy: Policy) -> Plan:
    """What `policy` keeps and deletes in `storage` (reads only)."""
    root = storage.root
    result = Plan(label, storage)
    held = ownership.holder(root)
    if held is not None:
        result.skipped = f"in use by {held}: a running launch; nothing is touched"
        return result
    protected = {e.checkpoint: e.name for e in registry.read(root)}
    committed = newest_first(ownership.committed(storage.step_dirs()))
    for i, loc in enumerate(committed):
        step = step_of(loc) or 0
        why = [f"among the newest {policy.keep_last}"] if i < policy.keep_last else []
        if policy.keep_every and step % policy.keep_every == 0:
            why.append(f"a multiple of {policy.keep_every}")
        if loc.name in protected:
            why.append(f"registered as {protected[loc.name]!r}")
        if why:
            result.keep.append((loc.name, ", ".join(why)))
        else:
            every = f", not a multiple of {policy.keep_every}" if policy.keep_every else ""
            result.delete.append((loc, f"older than the newest {policy.keep_last}{every}, not "
                                       "registered", _size(loc)))
    for loc in discovery.uncommitted(storage):
        result.delete.append((loc, "a save that was interrupted before its commit (never "
                                   "loaded)", _size(loc)))
    for line in sorted((root / ABANDONED).iterdir()) if (root / ABANDONED).is_dir() else []:
        for loc in newest_first(line.iterdir()):
            name = f"{ABANDONED}/{line.name}/{loc.name}"
            if name in protected:
                result.keep.append((name, f"registered as {protected[name]!r}"))
            elif policy.drop_abandoned:
                result.delete.append((loc, "a line a branch left behind (--drop-abandoned)",
                                      _size(loc)))
            else:
                result.keep.append((name, "a line a branch left behind (--drop-abandoned "
                                          "deletes it)"))
    return result


def apply(result: Plan) -> list[str]:
    """Delete what `result` lists, under the location's launch lock; what was deleted."""
    if result.skipped is not None or not result.delete:
        return []
    root = result.storage.root
    lock = ownership.lock_for(root)
    held = lock.try_acquire(f"gc-{ownership.launch_id()}", "gc")
    if held is not None:  # a launch started since the plan was made
        result.skipped = f"in use by {held}: a running launch; nothing is touched"
        return []
    deleted = []
    try:
        for loc, _, _ in result.delete:
            result.storage.remove(loc)
            deleted.append(str(loc))
            parent = loc.parent
            if isinstance(parent, Path) and parent.parent.name == ABANDONED \
                    and not any(parent.iterdir()):
                parent.rmdir()
    finally:
        lock.release()  # (the lock file stays: unlinking it could split a launch's lock)
    return deleted


def _size(loc: Location) -> int:
    sizes = list_files(loc)
    meta = loc / META
    return sum(sizes.values()) + (meta.stat().st_size if meta.exists() else 0)
