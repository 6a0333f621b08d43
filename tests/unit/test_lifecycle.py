"""The run's lifecycle on synthetic checkpoints (a real Checkpointer on a 6-number model): the hash
chain across saves, loads and re-saves, and the first broken link named; registered checkpoints
kept by retention; `register` reading the run's evaluation back; a branch moving the newer
checkpoints aside under the lock and being marked; the MLflow registry when it is configured."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import chain, ownership, registry
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.discovery import newest_complete, run_checkpoints
from shardwise.checkpoint.layout import ABANDONED, META, step_dir_name
from shardwise.errors import UserError
from shardwise.run import branch
from shardwise.run.register import register
from shardwise.spec import RunSpec


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), value))


def save(ckpt: Checkpointer, step: int) -> Path:
    return Path(ckpt.save(step, {"model": Weights(float(step))}, {}))


def run_dir_with(tmp_path: Path, steps: tuple[int, ...], keep_last: int = 0) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.toml").write_text("")
    ckpt = Checkpointer(run / "checkpoints", 0, False, keep_last=keep_last)
    for step in steps:
        save(ckpt, step)
    events = [{"kind": "step", "step": s, "loss": 5.0 - s / 10, "tokens_seen": 64 * s}
              for s in range(1, max(steps) + 1)]
    events += [{"kind": "eval", "step": s, "val_loss": 6.0 - s / 10, "val_accuracy": None,
                "eval_tokens": 256} for s in steps]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def link(root: Path, step: int) -> dict:
    return json.loads((root / step_dir_name(step) / META).read_text())[chain.KEY]


def test_chain_links_saves_loads_and_resaves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    first = Checkpointer(root, 0, False)
    save(first, 2)
    save(first, 4)
    meta2 = (root / "step-000002" / META).read_text()
    assert link(root, 2) == {"prev_step": None, "prev_meta_sha256": None}
    assert link(root, 4) == {"prev_step": 2, "prev_meta_sha256": chain.digest(meta2)}
    second = Checkpointer(root, 0, False)  # a resume: the next save descends from the load
    second.load(root / "step-000004", {"model": Weights(0.0)})
    save(second, 6)
    save(second, 6)  # a re-save of step 6 keeps step 6's parent, not itself
    assert link(root, 6)["prev_step"] == 4
    report = chain.verify(root, [root / n for n in ("step-000002", "step-000004", "step-000006")])
    assert report.ok and report.links == 2 and "starts at step-000002" in report.stop


def test_verify_chain_names_the_first_broken_link(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, 0, False)
    for step in (2, 4, 6):
        save(ckpt, step)
    dirs = sorted(root.glob("step-*"))
    meta = json.loads((root / "step-000004" / META).read_text())
    meta["consumed_samples"] = 999  # a quiet rewrite: files still match, the link does not
    (root / "step-000004" / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
    report = chain.verify(root, dirs)
    assert not report.ok and report.broken.startswith("step-000004: its meta.json hashes to")
    assert "step-000006 recorded" in report.broken
    # a checkpoint from before the chain: not a failure, the walk stops there
    for step in (2, 4, 6):
        meta = json.loads((root / step_dir_name(step) / META).read_text())
        meta.pop(chain.KEY)
        (root / step_dir_name(step) / META).write_text(json.dumps(meta))
    report = chain.verify(root, dirs)
    assert report.ok and report.stop.startswith("no chain before step 6")


def test_registered_checkpoint_survives_retention(tmp_path: Path) -> None:
    run = run_dir_with(tmp_path, (2,), keep_last=1)
    entry = register(run, "early")
    assert (entry.step, entry.record["eval"]["val_loss"]) == (2, pytest.approx(5.8))
    assert entry.record["eval"]["train_loss"] == pytest.approx(4.8)
    ckpt = Checkpointer(run / "checkpoints", 0, False, keep_last=1)
    for step in (4, 6):
        save(ckpt, step)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-000002", "step-000006"]


def test_register_refuses_bad_input(tmp_path: Path) -> None:
    run = run_dir_with(tmp_path, (2, 4))
    for name, needle in (("3rd", "must start with a letter"), ("a b", "must start with a letter")):
        with pytest.raises(UserError, match=needle):
            register(run, name)
    with pytest.raises(UserError, match=r"no committed checkpoint at that step \(committed: 2, 4\)"):
        register(run, "x", step=3)
    register(run, "best", step=4)
    assert register(run, "best", step=4).step == 4  # the same again: nothing changes
    with pytest.raises(UserError, match=r"already registered .* for step-000004"):
        register(run, "best", step=2)
    with pytest.raises(UserError, match="not a run directory"):
        register(tmp_path, "best")


def test_branch_moves_newer_checkpoints_aside_and_is_marked(tmp_path: Path) -> None:
    run = run_dir_with(tmp_path, (2, 4, 6))
    register(run, "mid", step=4)
    register(run, "last", step=6)
    root = run / "checkpoints"
    with pytest.raises(UserError, match=r"no committed checkpoint at step 5 .*steps 2, 4, 6; "
                                        r"registered: mid, last"):
        branch.make_branch(run, RunSpec(), "5", "id")
    with pytest.raises(UserError, match=r"no checkpoint of .* is registered under that name"):
        branch.make_branch(run, RunSpec(), "nope", "id")
    lock = ownership.FileLock(root)
    assert lock.try_acquire("other-launch", "id") is None
    try:
        with pytest.raises(UserError, match="while it is running"):
            branch.make_branch(run, RunSpec(), "mid", "id")
    finally:
        lock.release()
    notes = branch.make_branch(run, RunSpec(), "mid", "id")
    assert "steps 6" in notes[0]
    assert newest_complete(run_checkpoints(run)).name == "step-000004"
    (aside,) = (root / ABANDONED).iterdir()
    assert [p.name for p in aside.iterdir()] == ["step-000006"]
    moved = registry.find(root, "last")
    assert moved is not None and moved.checkpoint == f"{ABANDONED}/{aside.name}/step-000006"
    assert registry.protected_steps(root) == {4}  # a new step 6 is not the registered one
    marked = branch.marked(run, root / "step-000004")
    assert marked["from_step"] == 4 and marked["name"] == "mid" and marked["abandoned_steps"] == [6]
    assert branch.marked(run, root / "step-000002") is None
    with pytest.raises(UserError, match="on a line an earlier branch left behind"):
        branch.make_branch(run, RunSpec(), "last", "id")


def test_register_in_mlflow_when_configured(tmp_path: Path, monkeypatch) -> None:
    calls: list[tuple] = []

    class Client:
        def create_registered_model(self, name):
            calls.append(("model", name))

        def create_model_version(self, name, source, run_id=None, tags=None):
            calls.append(("version", name, source, tags["shardwise.val_loss"]))
            return types.SimpleNamespace(version=3)

    fake = types.ModuleType("mlflow")
    fake.set_tracking_uri = lambda uri: calls.append(("uri", uri))
    fake.MlflowClient = Client
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    run = run_dir_with(tmp_path, (2,))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert "mlflow" not in register(run, "local-only").record  # no tracking URI: file only
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:secret@mlflow.example:5000")
    entry = register(run, "tracked")
    assert entry.record["mlflow"]["version"] == "3"
    assert "secret" not in json.dumps(entry.record)
    assert ("version", "tracked", str(run / "checkpoints" / "step-000002"), "5.8") in calls
