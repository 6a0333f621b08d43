"""One discovery rule for resume, export and status: step directories by number, newest first;
staging and half-replaced directories never count; a newer checkpoint that does not verify is
skipped and named; a run whose checkpoints live elsewhere is followed through location.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.discovery import checkpoint_at, newest_complete, run_checkpoints
from shardwise.checkpoint.layout import LOCATION_FILE, META, newest_first, step_dir_name, step_of
from shardwise.cluster.status import report
from shardwise.errors import UserError


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), value))


def save(root: Path, step: int) -> Path:
    return Path(Checkpointer(root, 0, False).save(step, {"model": Weights(float(step))},
                                                  {"step": step}))


def test_steps_are_ordered_by_number_not_by_name() -> None:
    names = [step_dir_name(s) for s in (999_999, 1_000_000, 12)] + ["step-000013.staging",
                                                                     "step-12", "notes"]
    assert [p.name for p in newest_first(Path(n) for n in names)] == [
        "step-1000000", "step-999999", "step-000012"]
    assert step_of(Path("step-000013.staging")) is None


def test_export_and_resume_pick_the_same_newest_verified_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / "checkpoints"
    for step in (2, 4, 6):
        save(root, step)
    # a crash after meta.json was written but before the rename: never a candidate
    shutil.copytree(root / "step-000006", root / "step-000008.staging")
    # step 6 damaged after its commit: sizes still match, the hash does not
    shard = next((root / "step-000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_at(run).location == root / "step-000004"  # hashed: 6 is rejected
    assert newest_complete(run_checkpoints(run)) == root / "step-000006"  # sizes only
    (root / "step-000006" / META).unlink()
    assert newest_complete(run_checkpoints(run)) == root / "step-000004"


def test_a_checkpoint_directory_is_taken_as_given(tmp_path: Path) -> None:
    path = save(tmp_path / "run" / "checkpoints", 3)
    found = checkpoint_at(path)
    assert (found.location, found.run_dir) == (path, tmp_path / "run")


def test_checkpoints_kept_elsewhere_are_found_from_the_run_directory(tmp_path: Path) -> None:
    elsewhere = tmp_path / "volume"
    save(elsewhere, 5)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LOCATION_FILE).write_text(json.dumps({"uri": str(elsewhere)}))
    assert checkpoint_at(run).location == elsewhere / "step-000005"
    assert f"newest checkpoint: {elsewhere / 'step-000005'}" in report(run)


def test_no_checkpoint_that_verifies_is_a_user_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    path = save(run / "checkpoints", 1)
    next(path.glob("*.distcp")).write_bytes(b"")
    with pytest.raises(UserError, match=r"no checkpoint that verifies.*step-000001"):
        checkpoint_at(run)
