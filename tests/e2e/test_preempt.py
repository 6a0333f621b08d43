"""Preemption: a signal (to one worker, or to the launcher as Slurm or a user sends it) stops every
rank after the same step, a checkpoint is committed, the launch exits with code 75, and resuming
ends in exactly the state of the uninterrupted run (invariant mode: bitwise) with an exact ledger."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardwise.errors import SpecError
from shardwise.resilience.preempt import MARKER, PREEMPTED_EXIT, agent_signals, parse_signals
from shardwise.run.launch import Preempted
from shardwise.verify.layouts import parse_layout
from shardwise.verify.runner import RunOutcome, layout_spec, run_layout

STEPS = 8


def _config(small_corpus: Path, tmp_path: Path) -> str:
    from shardwise.spec import spec_from_dict, spec_to_toml
    from tests.support.specs import tiny_spec_dict

    config = tmp_path / "job.toml"
    data = tiny_spec_dict(small_corpus, tmp_path / "unused", run={"determinism": "invariant"},
                          checkpoint={"enabled": True, "every": 3})
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return str(config)


def _spec(config: str, run_dir: Path, overrides: list[str]):
    spec = layout_spec(config, overrides, parse_layout("zero3-2"), run_dir, steps=STEPS)
    return spec.replace("checkpoint", enabled=True, every=3)


def _assert_same_state(outcome: RunOutcome, reference: RunOutcome) -> None:
    assert outcome.ledger_exact, outcome.ledger_problems
    assert outcome.losses == reference.losses
    for name, value in reference.params.items():
        assert torch.equal(outcome.params[name], value), name
    assert outcome.optim.keys() == reference.optim.keys()
    for name, value in reference.optim.items():
        assert torch.equal(outcome.optim[name], value), name


def _events(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory) -> RunOutcome:
    tmp = tmp_path_factory.mktemp("preempt-ref")
    run_dir = tmp / "uninterrupted"
    return run_layout("ref", _spec(_config(small_corpus, tmp), run_dir, []), run_dir)


@pytest.mark.grid  # 30 s; a signal during the final save stays in the default run
@pytest.mark.timeout(180)
def test_signal_to_one_rank_stops_all_and_resumes_bitwise(reference, small_corpus, tmp_path):
    """SIGUSR1 reaches rank 1 only, during step 4: both ranks agree to stop after step 5 (the
    flag's all-reduce is read one step later), between the step-3 and step-6 checkpoints."""
    config, run_dir = _config(small_corpus, tmp_path), tmp_path / "run"
    spec = _spec(config, run_dir, ['failure.faults="signal:rank=1:step=4:sig=SIGUSR1"',
                                   "failure.max_restarts=1"])  # a preemption is no failure
    with pytest.raises(Preempted, match=r"preempted by SIGUSR1 after step 5") as caught:
        run_layout("preempted", spec, run_dir)
    assert caught.value.exit_code == PREEMPTED_EXIT
    (event,) = _events(run_dir, "preempted")
    assert (event["step"], event["signal"], event["within_grace"]) == (5, "SIGUSR1", True)
    assert event["checkpoint"].endswith("step-000005")
    assert (run_dir / "checkpoints" / "step-000005" / "meta.json").exists()
    assert not _events(run_dir, "run_end") and not _events(run_dir, "restart")
    assert [e["step"] for e in _events(run_dir, "step")] == [1, 2, 3, 4, 5]

    resumed = run_layout("resumed", spec, run_dir, resume=True)
    assert not (run_dir / MARKER).exists()
    _assert_same_state(resumed, reference)


@pytest.mark.grid  # 14 s; the start-up phases are also checked in distributed/test_startup.py
@pytest.mark.timeout(180)
def test_a_signal_before_the_first_step_exits_75_and_loses_nothing(reference, small_corpus,
                                                                    tmp_path):
    """#26 item 4: the handlers are installed at the worker's first line, so SIGUSR1 to rank 1
    while the workers start (here: just after they joined the group; before, a signal any time
    before the trainer existed killed the workers, exit 1) stops every rank before the first
    step with exit 75; the next launch trains from step 0 to the uninterrupted result."""
    config, run_dir = _config(small_corpus, tmp_path), tmp_path / "run"
    spec = _spec(config, run_dir, ['failure.faults="signal:rank=1:phase=startup:sig=SIGUSR1"'])
    with pytest.raises(Preempted, match=r"preempted by SIGUSR1 during start-up \(join\), before "
                                        r"the first step: nothing was lost") as caught:
        run_layout("early", spec, run_dir)
    assert caught.value.exit_code == PREEMPTED_EXIT
    marker = json.loads((run_dir / MARKER).read_text())
    assert (marker["step"], marker["checkpoint"], marker["phase"]) == (None, None, "join")
    assert not (run_dir / "metrics.jsonl").exists()  # it stopped before its event log opened

    resumed = run_layout("resumed", spec.replace("failure", faults=""), run_dir, resume=True)
    _assert_same_state(resumed, reference)


@pytest.mark.timeout(180)
def test_a_signal_during_the_final_save_does_not_lose_it(reference, small_corpus, tmp_path):
    """#26 item 2: SIGUSR1 lands on rank 1 while the final asynchronous checkpoint is written
    (Slurm's --signal=USR1@grace as a job sized to its time limit ends). The handlers stay
    installed until the last commit (before, they were removed before the final save was waited
    for, so the signal killed the worker: nothing committed, exit 1): the save commits, the run
    ends normally and equals the uninterrupted one."""
    config, run_dir = _config(small_corpus, tmp_path), tmp_path / "run"
    fault = f"signal:rank=1:step={STEPS}:phase=checkpoint-write:sig=SIGUSR1"
    outcome = run_layout("final", _spec(config, run_dir, [f'failure.faults="{fault}"']), run_dir)
    assert (run_dir / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").exists()
    assert not (run_dir / MARKER).exists() and _events(run_dir, "run_end")
    _assert_same_state(outcome, reference)


@pytest.mark.slow  # ~40 s: a CLI launch, a signal mid-run, a resume
@pytest.mark.timeout(180)
def test_sigterm_to_the_launcher_exits_75_and_resumes_bitwise(reference, small_corpus, tmp_path):
    """`shardwise train --nproc 2` gets SIGTERM mid-run (as from Slurm or `kill`): the agent
    forwards it, the workers commit a checkpoint, the command exits 75 with one line."""
    from shardwise.spec import spec_to_toml

    config, run_dir = _config(small_corpus, tmp_path), tmp_path / "run"
    # every step sleeps 0.4 s (no effect on the numbers) so that the signal lands mid-run
    spec = _spec(config, run_dir, ['failure.faults="slow:ms=400"'])
    job = tmp_path / "preempt.toml"
    job.write_text(spec_to_toml(spec))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "train", str(job)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _logged_step(run_dir, 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == PREEMPTED_EXIT, err
    lines = [line for line in err.splitlines() if "preempted" in line]
    assert len(lines) == 1 and lines[0].startswith("preempted by SIGTERM after step"), err
    assert f"exit code {PREEMPTED_EXIT}" in lines[0] and "--resume" in lines[0]
    marker = json.loads((run_dir / MARKER).read_text())
    assert 2 <= marker["step"] < STEPS
    assert Path(marker["checkpoint"]).name == f"step-{marker['step']:06d}"
    assert "Traceback" not in err

    resumed = run_layout("resumed", spec.replace("failure", faults=""), run_dir, resume=True)
    _assert_same_state(resumed, reference)
    assert _events(run_dir, "resume")[-1]["path"].endswith(f"step-{marker['step']:06d}")


def _logged_step(run_dir: Path, step: int) -> bool:
    try:
        return any(e["step"] >= step for e in _events(run_dir, "step"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def test_preempt_signals_are_validated():
    assert parse_signals("SIGTERM, usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("") == ()
    with pytest.raises(SpecError, match=r"failure\.preempt_signals: 'SIGNOPE'"):
        parse_signals("SIGTERM,SIGNOPE")
    with pytest.raises(SpecError, match="'SIGKILL' is not a signal that can be caught"):
        parse_signals("SIGKILL")
    assert agent_signals("SIGUSR1,SIGTERM") == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    from shardwise.spec import load_spec

    with pytest.raises(SpecError, match=r"failure\.preempt_signals: 'USR9'"):
        load_spec(None, ['failure.preempt_signals="SIGTERM,USR9"'])
    with pytest.raises(SpecError, match=r"failure\.preempt_grace_s is 0.0; it must be at least 1"):
        load_spec(None, ["failure.preempt_grace_s=0"])
    assert load_spec(None, ['failure.preempt_signals=""']).failure.preempt_signals == ""



def test_checkpoints_disabled_means_none_even_at_a_preemption(small_corpus, tmp_path):
    """#26 item 11: `checkpoint.enabled = false` saves nothing — not at the end, not when a
    preemption stops the run (it used to save then): the run stops, says so, and writes no
    checkpoint."""
    from tests.support.specs import tiny_spec
    from tests.support.workers import train_single

    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 6}, checkpoint={"enabled": False},
                     failure={"faults": "signal:rank=0:step=2:sig=SIGUSR1"})
    result = train_single(spec)
    (event,) = _events(run_dir, "preempted")
    assert event["signal"] == "SIGUSR1" and not event["checkpoint"]
    assert len(result["losses"]) == event["step"] < 6
    assert not list(run_dir.glob("checkpoints/step-*")) and not _events(run_dir, "checkpoint")
