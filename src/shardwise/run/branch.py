"""`shardwise train --resume RUN_DIR --from NAME|STEP`: continue a run from a registered or an
older committed checkpoint, leaving the newer ones behind where nothing loads them.

The branch is made once, by the launcher, before any worker starts, under the location's launch
lock (a running launch of the run is refused): the committed checkpoints newer than the branch
point are moved to ROOT/abandoned/branch-<time>-from-<step>/ (a rename on disk; on object storage
a copy, meta.json last, then the original removed, meta.json first). From then on the branch
point is the run's newest checkpoint, so the one resume rule (`run.resume`) continues from it —
in this launch, after a restart and at every later `--resume` — and the branch's own later
checkpoints (which reuse the abandoned steps' numbers) can never be confused with the abandoned
ones. Registry entries of moved checkpoints follow them (`checkpoint.registry.moved`).

The branch is recorded in RUN_DIR/branch.json (the newest branch: what a launch that loads the
branch point marks) and RUN_DIR/branches.jsonl (every branch); the launch starting there marks
its manifest's lineage entry, its `resume` event and its ledger launch record with it.
"""

from __future__ import annotations

import getpass
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint import chain, ownership, registry
from shardwise.checkpoint.discovery import run_checkpoints
from shardwise.checkpoint.integrity import verify
from shardwise.checkpoint.layout import ABANDONED, META, step_dir_name, step_of
from shardwise.checkpoint.location import Location, RemotePath
from shardwise.checkpoint.storage import Storage
from shardwise.errors import UserError
from shardwise.spec.runspec import RunSpec
from shardwise.utils.files import atomic_write_text

BRANCH_FILE = "branch.json"
BRANCHES = "branches.jsonl"


@dataclass(frozen=True)
class Target:
    """The checkpoint a branch continues from."""

    location: Location
    step: int
    name: str | None  # the registry name it was asked by, if any


def resolve(storage: Storage[Any], target: str, run_dir: Path) -> Target:
    """`target` (a step number or a registry name) as a committed, verified checkpoint of the
    run's current line; a UserError naming what there is otherwise."""
    root = storage.root
    committed = sorted(s for p in ownership.committed(storage.step_dirs())
                       if (s := step_of(p)) is not None)
    names = [e.name for e in registry.read(root) if e.current]
    there = (f"its committed checkpoints are at steps {', '.join(map(str, committed)) or 'none'}"
             f"{'; registered: ' + ', '.join(names) if names else ''}")
    name: str | None = None
    if target.isdigit():
        step = int(target)
        if step not in committed:
            raise UserError(f"--from {target}: {run_dir} has no committed checkpoint at step "
                            f"{step} ({there}). Pass one of those steps or names.")
    else:
        entry = registry.find(root, target)
        if entry is None:
            raise UserError(f"--from {target}: no checkpoint of {run_dir} is registered under "
                            f"that name ({there}). Register one with `shardwise register "
                            f"{run_dir} --step N --name {target}`, or pass a step.")
        if not entry.current:
            raise UserError(f"--from {target}: that checkpoint is on a line an earlier branch "
                            f"left behind ({entry.checkpoint}). Move it back to "
                            f"{root}/{step_dir_name(entry.step)} first (with no newer "
                            "checkpoint there), or branch from a checkpoint of the current line.")
        step, name = entry.step, entry.name
        found = chain.digest((root / step_dir_name(step) / META).read_text()) \
            if step in committed else None
        if found != entry.meta_sha256:
            raise UserError(f"--from {target}: the checkpoint registered as {target} (step "
                            f"{step}) is no longer the one at {step_dir_name(step)} (its "
                            "meta.json differs from the registered one). Check the location "
                            f"with `shardwise inspect --verify-chain {run_dir}`.")
    location = root / step_dir_name(step)
    verdict = verify(location, 0, 1, False)
    if not verdict.valid:
        raise UserError(f"--from {target}: {location} does not verify "
                        f"({'; '.join(verdict.problems[:3])}). Restore its files, or branch "
                        "from another checkpoint.")
    return Target(location, step, name)


def make_branch(run_dir: Path, spec: RunSpec, target: str, run_id: str) -> list[str]:
    """Before any worker starts: check the branch point against `spec`, move the newer
    checkpoints aside under the launch lock and record the branch; returns notes to print."""
    from shardwise.run.resume import check_compatible
    from shardwise.run.rundir import checkpoint_spec

    storage = run_checkpoints(run_dir)
    root = storage.root
    ownership.check_owner(root, storage.step_dirs(), run_id, run_dir, fresh=False)
    storage.recover()
    point = resolve(storage, target, run_dir)
    saved = checkpoint_spec(point.location)
    if saved is not None:
        check_compatible(saved, spec, str(point.location))
    newer = sorted((p for p in ownership.committed(storage.step_dirs())
                    if (step_of(p) or 0) > point.step), key=lambda p: step_of(p) or 0)
    label = f"{point.name} ({point.location.name})" if point.name else point.location.name
    if not newer:
        return [f"note: {label} is the newest checkpoint of {run_dir}: continuing from it "
                "(nothing to branch from)"]
    lock = ownership.lock_for(root)
    holder = lock.try_acquire(ownership.launch_id(), run_id)
    if holder is not None:
        raise UserError(f"cannot branch {run_dir} while it is running: its checkpoint location "
                        f"{root} is in use by {holder}. Stop that launch first, then resume "
                        f"with --from {target} again.")
    try:
        when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        aside = root / ABANDONED / f"branch-{when}-from-{step_dir_name(point.step)}"
        renames = {}
        for old in newer:
            _move(storage, old, aside / old.name)
            renames[old.name] = f"{ABANDONED}/{aside.name}/{old.name}"
        registry.moved(root, renames)
    finally:
        lock.release()
    record = {"from_step": point.step, "checkpoint": str(point.location), "name": point.name,
              "meta_sha256": chain.digest((point.location / META).read_text()),
              "abandoned_steps": [step_of(p) for p in newer], "moved_to": str(aside),
              "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": who()}
    atomic_write_text(run_dir / BRANCH_FILE, json.dumps(record, indent=2) + "\n")
    with (run_dir / BRANCHES).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return [f"branch: continuing {run_dir} from {label}; the newer checkpoints (steps "
            f"{', '.join(str(s) for s in record['abandoned_steps'])}) are moved to {aside} and "
            "are never loaded"]


def marked(run_dir: Path | None, checkpoint: Location) -> dict[str, Any] | None:
    """The branch a launch loading `checkpoint` starts (RUN_DIR/branch.json names that very
    checkpoint: same step, same meta.json digest), or None."""
    if run_dir is None:
        return None
    try:
        record = json.loads((run_dir / BRANCH_FILE).read_text())
        if int(record["from_step"]) != step_of(checkpoint):
            return None
        if record.get("meta_sha256") != chain.digest((checkpoint / META).read_text()):
            return None
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return {k: record.get(k) for k in ("from_step", "checkpoint", "name", "meta_sha256",
                                       "abandoned_steps", "moved_to", "at")}


def _move(storage: Storage[Any], old: Location, new: Location) -> None:
    """Move one committed checkpoint so that at no moment two committed copies count: a rename
    on disk; on object storage a copy whose meta.json goes last (the copy lies outside the step
    directories anyway), then the original removed meta.json first."""
    if isinstance(old, Path) and isinstance(new, Path):
        new.parent.mkdir(parents=True, exist_ok=True)
        os.rename(old, new)
        return
    assert isinstance(old, RemotePath) and isinstance(new, RemotePath)
    keys = sorted(old.fs.find(old.key), key=lambda k: k.endswith(f"/{META}"))
    for key in keys:
        old.fs.copy(key, new.key + key[len(old.key):])
    storage.remove(old)


def who() -> str:
    """user@host, for the records of who branched, registered or deleted something."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{os.uname().nodename}"
