"""The run directory: where a run writes its spec, metrics, TensorBoard files and checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import META
from shardwise.errors import UserError
from shardwise.spec import RunSpec, load_spec, spec_to_toml
from shardwise.utils.files import atomic_write_text

SPEC_FILE = "spec.toml"
#: the run's id, made with its directory: what its checkpoint location records as its owner
RUN_ID_FILE = "run-id"
#: Workers started by `run.agent.launch_local` write user errors here instead of printing them N
#: times; the launcher prints one.
ERRORS_DIR = ".worker-errors"


def new_run_dir(spec: RunSpec) -> Path:
    """Create the directory for a fresh run; refuse one that already holds a run."""
    if spec.run.dir:
        path = Path(spec.run.dir).expanduser()
    else:
        path = Path("runs") / f"{spec.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while path.exists():
            path = path.with_name(f"{path.name.split('~')[0]}~{n}")
            n += 1
    if (path / SPEC_FILE).exists():
        raise UserError(
            f"run directory {path} already holds a run ({SPEC_FILE} exists). Continue it with "
            f"`shardwise train --resume {path}`, or choose a new directory with "
            "--set run.dir=PATH (leave run.dir empty for a fresh timestamped one)."
        )
    _ensure_writable(path)
    run_id(path)
    return path


def run_id(run_dir: Path) -> str:
    """The run's id (RUN_DIR/run-id), made the first time it is asked for: with the directory,
    or at the first resume of a directory made before ids were recorded. Two processes making
    it at once agree: each links a complete file into place, and the second link fails."""
    path = run_dir / RUN_ID_FILE
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    tmp = run_dir / f".{RUN_ID_FILE}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.write_text(uuid.uuid4().hex + "\n")
    try:
        os.link(tmp, path)  # atomic: exists with its content, or not at all
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def existing_run_dir(path_text: str) -> Path:
    path = Path(path_text).expanduser()
    if not (path / SPEC_FILE).is_file():
        raise UserError(
            f"--resume {path_text}: {path} is not a run directory (no {SPEC_FILE} in it). Pass the "
            "directory that `shardwise train` created, e.g. runs/shakespeare-gpt-20260101-120000."
        )
    _ensure_writable(path)
    return path


@dataclass(frozen=True)
class ResumePoint:
    """Where `--resume` will continue, decided before any worker starts (`run.resume`'s rule)."""

    checkpoint: Any  # the newest complete checkpoint (a Location), or None: step 0
    step: int
    complete: bool  # already at its last step, and nothing more asked for
    notes: tuple[str, ...] = ()


def resume_point(run_dir: Path, spec: RunSpec) -> ResumePoint:
    """The newest complete checkpoint of the run, checked against `spec` (same model, data and
    seed); step 0 when the run never committed one. Refuses a location another run owns."""
    from shardwise.checkpoint.discovery import newest_complete, run_checkpoints
    from shardwise.checkpoint.ownership import check_owner
    from shardwise.run.resume import check_compatible, complete, lr_change_note

    storage = run_checkpoints(run_dir)
    check_owner(storage.root, storage.step_dirs(), run_id(run_dir), run_dir, fresh=False)
    checkpoint = newest_complete(storage)
    if checkpoint is None:
        return ResumePoint(None, 0, False, (
            f"note: {run_dir} has no checkpoint yet (the run stopped before its first): "
            "training from step 0 in the same run directory",))
    saved = checkpoint_spec(checkpoint)
    step = int(json.loads((checkpoint / META).read_text())["step"])
    if saved is not None:
        check_compatible(saved, spec, str(checkpoint))
    done = complete(step, spec, saved or {}, str(run_dir))
    note = lr_change_note(saved, spec, step) if saved is not None and not done else None
    return ResumePoint(checkpoint, step, done, (note,) if note else ())


def check_fresh_location(spec: RunSpec) -> None:
    """A fresh run's checkpoint location (`checkpoint.uri`) must not hold another run's
    checkpoints: refused before any worker starts (a location in no run directory yet: the
    run's own RUN_DIR/checkpoints is new, so only an explicit `checkpoint.uri` can clash)."""
    if not spec.checkpoint.uri.strip():
        return
    from shardwise.checkpoint.location import StorageSpec
    from shardwise.checkpoint.ownership import check_owner
    from shardwise.checkpoint.storage import open_storage

    storage = open_storage(StorageSpec.from_section(spec.checkpoint), Path("."))
    check_owner(storage.root, storage.step_dirs(), "", Path(spec.run.dir or "."), fresh=True)


def checkpoint_spec(checkpoint: Any) -> dict[str, Any] | None:
    """The spec a checkpoint was trained with (its manifest's), or None for one without."""
    from shardwise.run.manifest import MANIFEST

    try:
        return dict(json.loads((checkpoint / MANIFEST).read_text())["spec"])
    except (FileNotFoundError, KeyError, ValueError, TypeError):
        return None


def load_run_spec(run_dir: Path, overrides: list[str]) -> RunSpec:
    return load_spec(run_dir / SPEC_FILE, overrides)


def write_spec(run_dir: Path, spec: RunSpec) -> None:
    atomic_write_text(run_dir / SPEC_FILE, spec_to_toml(spec))


def _ensure_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise UserError(
            f"run directory {path} is not writable ({err.strerror}). Choose a writable location "
            "with --set run.dir=PATH."
        ) from None
