"""A checkpoint location belongs to one run and is written by one launch at a time
(`shardwise.checkpoint.ownership`, #26 items 1 and 7). Before: a second run of the same TOML
replaced the first run's steps, pruned them by its own retention and resumed from them; two
launches deleted each other's staging; an interrupted save counted toward `keep_last` on S3 and
`.staging` leftovers were never removed."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import ownership
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.layout import META, OWNER
from shardwise.errors import UserError


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), value))


def claimed(root: Path, run_id: str, run_dir: Path, fresh: bool = True, **kw) -> Checkpointer:
    ckpt = Checkpointer(root, 0, False, **kw)
    ckpt.claim(run_id, run_dir, fresh, wait_s=0)
    return ckpt


def steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_the_first_save_makes_the_location_the_runs_and_another_run_is_refused(tmp_path):
    root = tmp_path / "shared"
    a = claimed(root, "run-a", tmp_path / "a")
    a.save(3, {"model": Weights(1.0)}, {})
    a.close()
    owner = json.loads((root / OWNER).read_text())
    assert owner["run_id"] == "run-a" and owner["run_dir"] == str((tmp_path / "a").resolve())
    assert json.loads((root / "step-000003" / META).read_text())["run_id"] == "run-a"
    for fresh in (True, False):  # a fresh run, or a resume of another run directory
        with pytest.raises(UserError, match=r"belongs to another run \(run directory .*a\)"):
            claimed(root, "run-b", tmp_path / "b", fresh)
    assert steps(root) == ["step-000003"]  # nothing of run A was touched
    claimed(root, "run-a", tmp_path / "a", fresh=False).close()  # its own run may go on


def test_a_fresh_run_refuses_checkpoints_nobody_owns(tmp_path):
    """Checkpoints copied in by hand (or written before owners were recorded) are not a fresh
    run's to replace; the run directory they came with resumes them and adopts the location."""
    root = tmp_path / "old"
    Checkpointer(root, 0, False).save(5, {"model": Weights(1.0)}, {})  # no claim: no owner
    assert not (root / OWNER).exists()
    with pytest.raises(UserError, match=r"holds committed checkpoints \(steps 5\).*fresh run"):
        claimed(root, "new", tmp_path / "new")
    resumed = claimed(root, "old-run", tmp_path / "old-run", fresh=False)
    resumed.save(6, {"model": Weights(2.0)}, {})
    resumed.close()
    assert ownership.read_owner(root).run_id == "old-run"


def test_retention_counts_and_removes_committed_checkpoints_only(tmp_path):
    root = tmp_path / "ckpt"
    ckpt = claimed(root, "r", tmp_path / "r", keep_last=2)
    for step in (1, 2):
        ckpt.save(step, {"model": Weights(float(step))}, {})
    # an interrupted save of step 3, in place as on object storage: no meta.json
    (root / "step-000003").mkdir()
    (root / "step-000003" / "__0_0.distcp").write_bytes(b"partial")
    ckpt.save(4, {"model": Weights(4.0)}, {})
    ckpt.close()
    # keep_last = 2 committed: steps 2 and 4 (before: the partial step 3 counted and pushed 2 out)
    assert [s for s in steps(root) if (root / s / META).exists()] == ["step-000002", "step-000004"]


def test_interrupted_saves_are_removed_when_the_location_is_claimed(tmp_path, capsys):
    root = tmp_path / "ckpt"
    (root / "step-000007.staging").mkdir(parents=True)
    (root / "step-000007.staging" / "__0_0.distcp").write_bytes(b"half")
    claimed(root, "r", tmp_path / "r", fresh=False).close()
    assert not (root / "step-000007.staging").exists()
    assert "removing" in capsys.readouterr().err


def _hold(root: str, ready, done) -> None:
    lock = ownership.FileLock(Path(root))
    assert lock.try_acquire("other-launch", "r") is None
    ready.set()
    done.wait(30)
    lock.release()


def test_one_launch_at_a_time_the_next_waits_then_is_refused(tmp_path):
    """Two launches of one run (a requeue while the old job drains): the second waits for the
    lock, and is refused naming the holder when it is not released in time; once it is, the
    second takes it. (Before: both saved, deleting each other's staging directories.)"""
    root = tmp_path / "ckpt"
    root.mkdir()
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(root), ready, done))
    holder.start()
    try:
        assert ready.wait(60)
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"in use by launch other-launch \(pid \d+ on .*waited 1 s"):
            Checkpointer(root, 0, False).claim("r", tmp_path / "r", False, wait_s=1.0)
        assert time.monotonic() - t0 >= 1.0
    finally:
        done.set()
        holder.join(30)
    claimed(root, "r", tmp_path / "r", fresh=False).close()  # released: the next launch gets it


def test_a_lease_on_object_storage_expires_when_its_holder_stops_renewing(tmp_path):
    """The lease (object storage's lock) held by a live launch refuses another; one a dead launch
    left behind expires after its lease time. Checked over a local path, which has the same
    read/write/unlink as a RemotePath."""
    root = tmp_path / "bucket"
    root.mkdir()
    first = ownership.LeaseLock(root, lease_s=0.4)
    assert first.try_acquire("launch-1", "r") is None
    assert "launch-1" in (ownership.LeaseLock(root).try_acquire("launch-2", "r") or "")
    first._stop.set()  # the holder dies: nobody renews
    first._thread.join()
    time.sleep(0.5)
    second = ownership.LeaseLock(root)
    assert second.try_acquire("launch-2", "r") is None
    second.release()
    assert not (root / "lock.json").exists()
