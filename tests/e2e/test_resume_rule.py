"""One rule decides whether a launch resumes (`shardwise.run.resume`), the same under every
launcher: asked for (--resume) -> a checkpoint must exist; a restart -> the newest valid
checkpoint, or step 0 again when the failure came before the first one; otherwise fresh.
Checked under shardwise's own elastic launcher and under torchrun --max-restarts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.data.ledger import audit
from shardwise.run.resume import ResumeMode, resume_mode
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.specs import tiny_spec_dict


def test_the_rule():
    assert resume_mode(False, 0) is ResumeMode.FRESH
    assert resume_mode(False, 2) is ResumeMode.IF_ANY
    assert resume_mode(True, 0) is ResumeMode.REQUIRED
    assert resume_mode(True, 1) is ResumeMode.REQUIRED


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


CASES = [pytest.param(0, 2, 0, id="before-first-checkpoint"),
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
                         [CASES[0], pytest.param(2, 3, 2, id="after-a-checkpoint",
                                                 marks=pytest.mark.grid)])
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
