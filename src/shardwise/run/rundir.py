"""The run directory: where a run writes its spec, metrics, TensorBoard files and checkpoints."""

from __future__ import annotations

import os
import time
from pathlib import Path

from shardwise.errors import UserError
from shardwise.spec import RunSpec, load_spec, spec_to_toml
from shardwise.utils.files import atomic_write_text

SPEC_FILE = "spec.toml"
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
    return path


def existing_run_dir(path_text: str) -> Path:
    path = Path(path_text).expanduser()
    if not (path / SPEC_FILE).is_file():
        raise UserError(
            f"--resume {path_text}: {path} is not a run directory (no {SPEC_FILE} in it). Pass the "
            "directory that `shardwise train` created, e.g. runs/shakespeare-gpt-20260101-120000."
        )
    _ensure_writable(path)
    return path


def resume_checkpoint(run_dir: Path, spec: RunSpec) -> Path:
    """The newest complete checkpoint of the run, checked to leave steps to train."""
    import json

    from shardwise.checkpoint.discovery import newest_complete, run_checkpoints
    from shardwise.checkpoint.layout import META

    checkpoint = newest_complete(run_checkpoints(run_dir))
    if checkpoint is None:
        raise UserError(
            f"nothing to resume in {run_dir}: no complete checkpoint under "
            f"{run_dir / 'checkpoints'}. Start a fresh run instead, or check that the earlier "
            "run reached a checkpoint (checkpoint.every, run.stop_at)."
        )
    check_steps_left(run_dir, int(json.loads((checkpoint / META).read_text())["step"]), spec)
    return checkpoint


def check_steps_left(run_dir: Path, step: int, spec: RunSpec) -> None:
    """Refuse to resume a run that is already at its last step, saying how to extend it."""
    if step < (spec.run.stop_at or spec.run.steps):
        return
    how = (f"--set run.stop_at=0 to run on to run.steps = {spec.run.steps} (or stop_at=N "
           f"for some N > {step})") if spec.run.stop_at and spec.run.steps > step else \
        f"--set run.steps=N for some N > {step}"
    raise UserError(
        f"{run_dir} is already at step {step}, the end of the run (run.steps = "
        f"{spec.run.steps}, run.stop_at = {spec.run.stop_at}). To train further, resume with "
        f"{how}."
    )


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
