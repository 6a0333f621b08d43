"""Hangs, collective mismatches and stragglers become messages naming the rank.

The hang and mismatch drills run the real `shardwise train` (elastic agent, 2 workers) and must
end within hang_timeout_s + 30 s with a report naming the rank that diverged."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.resilience.flight import FlightRecorder, read_all
from shardwise.resilience.hang import diagnose
from shardwise.spec import spec_from_dict, spec_to_toml
from shardwise.telemetry.straggler import StragglerDetector
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec, tiny_spec_dict
from tests.support.workers import train

HANG_TIMEOUT = 4.0


def _config(small_corpus: Path, tmp_path: Path, faults: str) -> Path:
    data = tiny_spec_dict(small_corpus, tmp_path / "run",
                          run={"steps": 6},
                          parallel={"nproc": 2, "dp_replicate": 2, "dp_shard": 1, "timeout_s": 120},
                          failure={"faults": faults, "hang_timeout_s": HANG_TIMEOUT})
    config = tmp_path / "job.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return config


def _train(config: Path, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", str(config)], cwd=cwd,
                          text=True, capture_output=True, timeout=HANG_TIMEOUT + 150)
    return proc, time.monotonic() - t0


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.grid  # 21 s; the diagnosis itself is checked on planted flight records above
@pytest.mark.timeout(200)
def test_planted_hang_is_reported_with_the_rank(small_corpus, tmp_path):
    config = _config(small_corpus, tmp_path, "hang:rank=1:step=3:phase=forward")
    proc, seconds = _train(config, tmp_path)
    assert proc.returncode != 0
    report = (tmp_path / "run" / "diagnostics" / "attempt-0" / "hang-report.txt").read_text()
    assert "Diverged: rank 1." in report, report
    assert "rank 1: step 3, phase forward" in report, report
    assert "Diverged: rank 1." in proc.stderr  # the user sees it, not only the file
    assert (tmp_path / "run" / "diagnostics" / "attempt-0" / "stacks-rank-1.txt").read_text() \
        .count("faults.py")  # the hung rank's stack shows where it is stuck
    # the run ended well within the watchdog timeout + 30 s of the hang (startup excluded)
    hang_events = [e for e in _events(tmp_path / "run") if e["kind"] == "hang"]
    assert hang_events and hang_events[0]["ranks"] == [1]
    first_step = min(e["time"] for e in _events(tmp_path / "run") if e["kind"] == "run_start")
    assert hang_events[0]["time"] - first_step < HANG_TIMEOUT + 30, seconds


@pytest.mark.grid  # 10 s; the planted hang stays in the default run
@pytest.mark.timeout(200)
def test_planted_collective_mismatch_names_the_rank(small_corpus, tmp_path):
    config = _config(small_corpus, tmp_path, "mismatch:rank=1:step=2:phase=backward")
    proc, _ = _train(config, tmp_path)
    assert proc.returncode != 0
    report = (tmp_path / "run" / "diagnostics" / "attempt-0" / "hang-report.txt").read_text()
    assert "collective mismatch" in report, report
    assert "Diverged: rank 1." in report, report
    assert "all_reduce of 4 B" in report, report  # the stray 1-element all-reduce
    assert "Diverged: rank 1." in proc.stderr


def test_diagnosis_names_the_rank_that_fell_behind(tmp_path):
    """Unit level: rank 0 waits in all_reduce #3 that rank 1 never issued."""
    recorders = [FlightRecorder(tmp_path, r, 2) for r in range(2)]
    for r, rec in enumerate(recorders):
        for _ in range(2 if r == 1 else 3):
            slot = rec.issue("all_reduce", "dp", 1024, 5)
            if not (r == 0 and _ == 2):
                rec.complete(slot)
        rec.progress(5, "backward" if r == 0 else "forward")
    diagnosis = diagnose(read_all(tmp_path), 2)
    assert diagnosis.ranks == [1]
    assert "never issued" in diagnosis.findings[0]
    assert read_all(tmp_path)[1].phase == "forward"


def test_straggler_detector_needs_a_persistent_excess():
    detector = StragglerDetector(factor=1.5, windows=2)
    assert detector.observe([0.10, 0.30]) == []  # first window: not yet persistent
    found = detector.observe([0.10, 0.31])
    assert [s.rank for s in found] == [1] and found[0].ratio == pytest.approx(3.1)
    assert detector.observe([0.10, 0.11]) == []  # back to normal: the streak resets
    assert detector.observe([0.20, 0.10, 0.11, 0.12]) == []


@pytest.mark.timeout(200)
def test_planted_slow_rank_is_named_as_straggler(small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 6},
                     parallel={"nproc": 2, "dp_replicate": 2, "dp_shard": 1},
                     failure={"faults": "slow:rank=1:ms=120", "straggler_windows": 2})
    run_ranks(train, 2, spec, timeout=150)
    events = _events(tmp_path / "run")
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert stragglers and {e["straggler_rank"] for e in stragglers} == {1}
    assert all(e["ratio"] > 1.5 for e in stragglers)
    steps = [e for e in events if e["kind"] == "step"]
    # per-rank step times hide it (collectives equalise them); compute time shows it
    last = steps[-1]
    assert last["compute_s_per_rank"][1] > last["compute_s_per_rank"][0] + 0.08
    # without that equalising the step times would differ by the planted 120 ms; the median over
    # the steps, so one step of a rank descheduled on a loaded machine does not decide it
    gaps = sorted(abs(e["step_time_s_per_rank"][1] - e["step_time_s_per_rank"][0]) for e in steps)
    assert gaps[len(gaps) // 2] < 0.06, gaps
    assert "rank 1 is a straggler" in (last["straggler"] or "")
