"""Against a real Slurm (marker `slurm`; `pytest -m slurm`): a single-node cluster on 127.0.0.1
(tests/support/slurm_cluster.py) runs a 2-worker shardwise job submitted by `shardwise launch --slurm`;
then a job is preempted with `scancel --signal=USR1`, commits a checkpoint, requeues itself, and
the requeued run resumes and ends with the losses of the uninterrupted job, bit for bit.

Outside CI, a machine without Slurm skips these tests with the reason; in CI ($CI set) that is a
failure: `.ci/run` installs the packages.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.cluster import slurm
from shardwise.data.ledger import audit
from shardwise.resilience.preempt import MARKER
from tests.support import slurm_cluster

# also `slow`: outside the default `pytest`, inside `pytest -m "grid or slow"` (CI)
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    absent = slurm_cluster.missing()
    if absent:
        reason = (f"Slurm is not installed ({', '.join(absent)} missing): apt-get install "
                  "slurm-wlm munge")
        if os.environ.get("CI"):
            pytest.fail(f"{reason} — CI must run the Slurm tests (.ci/run installs it)")
        pytest.skip(reason)
    instance = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="module")
def job_config(small_corpus, tmp_path_factory) -> Path:
    from shardwise.spec import spec_from_dict, spec_to_toml
    from tests.support.specs import tiny_spec_dict

    tmp = tmp_path_factory.mktemp("slurm-config")
    data = tiny_spec_dict(small_corpus, tmp / "unused", run={"determinism": "invariant",
                                                              "steps": STEPS},
                          parallel={"zero": 3}, checkpoint={"enabled": True, "every": 4})
    config = tmp / "job.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return config


def _submit(capsys, config: Path, run_dir: Path, *extra: str) -> str:
    code = main(["launch", str(config), "--slurm", "--nodes", "1", "--nproc-per-node", "2",
                 "--set", f'run.dir="{run_dir}"', *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    job_id = slurm.recorded_job(run_dir)
    assert job_id is not None and f"submitted Slurm job {job_id}" in out
    return job_id


def _events(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return [e for e in events if e["kind"] == kind]


def _losses(run_dir: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in _events(run_dir, "step")}


def test_job_runs_to_the_end_and_status_reports_it(cluster, job_config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    job_id = _submit(capsys, job_config, run_dir, "--time", "10")
    state = cluster.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 240)
    output = "\n".join(p.read_text() for p in run_dir.glob("slurm-*.out"))
    assert state == "COMPLETED", output
    (end,) = _events(run_dir, "run_end")
    assert end["step"] == STEPS
    assert [e["world_size"] for e in _events(run_dir, "run_start")] == [2]
    assert sorted(_losses(run_dir)) == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / f"step-{STEPS:06d}" / "meta.json").exists()
    assert audit(run_dir).exact
    assert main(["status", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"slurm job {job_id}: COMPLETED (exit code 0:0)"
    assert lines[2].startswith(f"last step {STEPS}: loss ")
    (tmp_path.parent / "reference-losses.json").write_text(json.dumps(_losses(run_dir)))


def test_scancel_usr1_preempts_requeues_and_resumes_bitwise(cluster, job_config, tmp_path,
                                                            capsys):
    reference_file = tmp_path.parent / "reference-losses.json"
    if not reference_file.exists():
        pytest.skip("needs the uninterrupted job of the test before")
    reference = {int(k): v for k, v in json.loads(reference_file.read_text()).items()}
    run_dir = tmp_path / "run"
    # 0.5 s per step (sleep only: the numbers do not change) so that the signal lands mid-run
    job_id = _submit(capsys, job_config, run_dir, "--requeue",
                     "--set", 'failure.faults="slow:ms=500"')
    deadline = time.monotonic() + 180
    while not any(e["step"] >= 2 for e in _events(run_dir, "step")):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.1)
    cluster.run("scancel", "--signal=USR1", job_id)
    deadline = time.monotonic() + 240
    hurried = False
    while not _events(run_dir, "run_end"):
        assert time.monotonic() < deadline, f"{cluster.job_state(job_id)}\n{cluster.logs()}"
        if not hurried and cluster.job_state(job_id) == "PENDING":
            # Slurm holds a requeued job back for ~2 minutes (its eligible time); skip most of
            # that wait, but not all: slurmd revokes the old instance's credential with
            # one-second resolution, and a start within that second is killed as revoked
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
            hurried = True
        time.sleep(0.3)
    assert hurried  # the job requeued itself
    state = cluster.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    output = "\n".join(p.read_text() for p in run_dir.glob("slurm-*.out"))
    assert state == "COMPLETED", output
    (preempted,) = _events(run_dir, "preempted")
    assert preempted["signal"] == "SIGUSR1" and 2 <= preempted["step"] < STEPS
    assert "shardwise: preempted" in output
    (resume,) = _events(run_dir, "resume")
    assert resume["path"].endswith(f"step-{preempted['step']:06d}")
    assert not (run_dir / MARKER).exists()
    assert _losses(run_dir) == reference
    report = audit(run_dir)
    assert report.exact, report.problems
