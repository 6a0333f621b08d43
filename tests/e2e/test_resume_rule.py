"""One rule decides whether a launch resumes (`shardwise.run.resume`), the same under every
launcher: continued (--resume, which Slurm requeues and `shardwise launch` use too, or a restart)
-> the newest valid checkpoint, or step 0 when the run never committed one; otherwise fresh. A
resume may not change the model, data or seed; one of a complete run is a no-op. Checked under
shardwise's own elastic launcher, under torchrun --max-restarts, and through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.data.ledger import audit
from shardwise.run.resume import ResumeMode, resume_mode
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.cli import assert_user_error, flat
from tests.support.specs import tiny_spec_dict


def test_the_rule():
    assert resume_mode(False, 0) is ResumeMode.FRESH
    assert resume_mode(False, 2) is ResumeMode.CONTINUE
    assert resume_mode(True, 0) is ResumeMode.CONTINUE
    assert resume_mode(True, 1) is ResumeMode.CONTINUE


def test_resume_continues_a_run_that_died_before_its_first_checkpoint(small_corpus, tmp_path,
                                                                      capsys):
    """#26 items 3 and 11: `--resume` (what a Slurm requeue and `shardwise launch` run once
    spec.toml exists) of a run that died before its first checkpoint trains it from step 0 in
    the same directory (before: exit 2 on every requeue, so the job could never start again);
    a resume may not change the model, data or seed (data.seq_len was not checked); one that
    stretches the schedule says how the learning rate moves; resuming a complete run is a no-op
    with exit 0 (before: exit 2), unless it asked for a length the run already passed."""
    run_dir = tmp_path / "run"
    data = tiny_spec_dict(small_corpus, run_dir, run={"dir": str(run_dir), "steps": 4},
                          checkpoint={"enabled": True, "every": 0, "async_save": False})
    config = tmp_path / "job.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    died = subprocess.run([sys.executable, "-m", "shardwise", "train", str(config)], cwd=tmp_path,
                          text=True, capture_output=True, timeout=200,
                          env={**os.environ, "SHARDWISE_FAULTS": "kill:step=2"})
    assert died.returncode != 0 and not (run_dir / "checkpoints" / "step-000002").exists()

    assert main(["train", "--resume", str(run_dir)]) == 0
    err = flat(capsys.readouterr().err)
    assert "has no checkpoint yet" in err and "training from step 0" in err
    assert audit(run_dir).exact and audit(run_dir).steps == 4
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "run_start"] == [0, 0]

    for change, field in (("run.seed=8", "run.seed"), ("data.seq_len=16", "data.seq_len"),
                          ("model.d_model=32", "model.d_model")):
        assert_user_error((main(["train", "--resume", str(run_dir), "--set", change]),
                           *capsys.readouterr()), f"it was trained with {field}",
                          "start a new run")
    assert main(["train", "--resume", str(run_dir)]) == 0  # complete: nothing to do
    assert "is complete" in flat(capsys.readouterr().err)
    assert_user_error((main(["train", "--resume", str(run_dir), "--set", "run.steps=3"]),
                       *capsys.readouterr()), "already at step 4", "run.steps=N for some N > 4")

    assert main(["train", "--resume", str(run_dir), "--set", "run.steps=6"]) == 0
    err = flat(capsys.readouterr().err)
    assert "the learning rate at step 4 moves from" in err and "run.steps 4 -> 6" in err
    assert audit(run_dir).exact and audit(run_dir).steps == 6


def _config(small_corpus, tmp_path, run_dir: str, every: int) -> Path:
    config = tmp_path / "job.toml"
    data = tiny_spec_dict(small_corpus, Path(run_dir), run={"dir": run_dir, "steps": 5},
                          # synchronous saves: the kill must come after a committed checkpoint
                          checkpoint={"enabled": True, "every": every, "async_save": False},
                          parallel={"nproc": 2})
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return config


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check(run_dir: Path, resumed_from: int) -> None:
    events = _events(run_dir)
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["attempt"] == 1 and restart["resumed_from_step"] == resumed_from
    resumes = [e["step"] for e in events if e["kind"] == "resume"]
    assert resumes == ([resumed_from] if resumed_from else [])
    assert max(e["step"] for e in events if e["kind"] == "step") == 5
    assert (run_dir / "checkpoints" / "step-000005" / "meta.json").is_file()
    report = audit(run_dir)
    assert report.exact and report.steps == 5, report.problems


# 22 s each; the rule itself (--resume of a run that never committed) is in the default run
CASES = [pytest.param(0, 2, 0, id="before-first-checkpoint", marks=pytest.mark.grid),
         pytest.param(2, 3, 2, id="after-a-checkpoint", marks=pytest.mark.grid)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("every", "kill_step", "resumed_from"), CASES)
def test_restart_under_the_elastic_launcher(every, kill_step, resumed_from, small_corpus,
                                            tmp_path):
    run_dir = tmp_path / "run"
    config = _config(small_corpus, tmp_path, str(run_dir), every)
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", str(config), "--set",
         "failure.max_restarts=1", "--set", f'failure.faults="kill:rank=1:step={kill_step}"'],
        cwd=tmp_path, text=True, capture_output=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    _check(run_dir, resumed_from)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("every", "kill_step", "resumed_from"),
                         [pytest.param(0, 2, 0, id="before-first-checkpoint",
                                       marks=pytest.mark.grid),
                          pytest.param(2, 3, 2, id="after-a-checkpoint", marks=pytest.mark.grid)])
def test_restart_under_torchrun_without_a_run_dir(every, kill_step, resumed_from, small_corpus,
                                                  tmp_path):
    """No run.dir: the first attempt picks runs/<name>-<time> and records it in torchrun's store;
    the restarted attempt continues in it (before: a restart before the first checkpoint was
    fatal under torchrun, and without run.dir a restart started a second run directory)."""
    config = _config(small_corpus, tmp_path, "", every)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", "-m", "shardwise", "train", str(config), "--set",
         f'failure.faults="kill:rank=1:step={kill_step}"'],
        cwd=tmp_path, text=True, capture_output=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    _check(runs[0], resumed_from)


@pytest.mark.timeout(240)
def test_a_native_crash_is_named_and_its_stack_printed(small_corpus, tmp_path):
    """A worker that dies of SIGSEGV (a crash in torch, a collective library or an extension;
    here the `crash` fault) prints every thread's Python stack before it dies, and the
    launcher's one paragraph names the signal and points at that stack, not "exit code -11"."""
    run_dir = tmp_path / "run"
    config = _config(small_corpus, tmp_path, str(run_dir), 0)
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", str(config), "--set",
         'failure.faults="crash:rank=1:step=2"'],
        cwd=tmp_path, text=True, capture_output=True, timeout=200)
    assert proc.returncode == 1, proc.stderr
    assert "Fatal Python error: Segmentation fault" in proc.stderr
    assert "resilience/faults.py" in proc.stderr  # where the crash happened, from its stack
    err = flat(proc.stderr)
    assert "rank 1 killed by SIGSEGV" in err and "a crash in native code" in err
    assert "Fatal Python error" in err.split("training failed:")[-1]  # the pointer to the stack
    assert "Traceback" not in proc.stderr  # one paragraph, no Python traceback of the CLI
