"""A whole node (agent and worker) lost, on each side of the rendezvous store (#26 item 10), and
the normal end of the same job: two `shardwise launch --exec` agents on 127.0.0.1, one worker
each, node rank 0 hosting the store (`--rdzv-conf is_host=true`).

- another node lost and started again: the elastic restart resumes from the last checkpoint and
  the job ends with the losses of the uninterrupted job, bit for bit, and an exact ledger;
- the store's node lost: the other agent ends within the store's timeout with one paragraph
  naming what happened and exit code 75 (a relaunch or a Slurm requeue resumes);
- the normal end: both agents exit 0, with no store error said.

Grid (CI's second command): each drill is two agents and their restarts, about a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.cluster.node import LOST_MARKER

pytestmark = [pytest.mark.grid, pytest.mark.timeout(240)]
STEPS = 8
#: SIGTERM'd workers get this long before the agent kills them (failure.preempt_grace_s)
GRACE_S = 5
#: the store's read timeout (torch's default) plus the workers' grace: the bound on an ending
STORE_TIMEOUT_S = 60 + GRACE_S
OVERRIDES = (f"run.steps={STEPS}", "checkpoint.enabled=true", "checkpoint.every=3",
             "parallel.zero=3", "failure.max_restarts=1", f"failure.preempt_grace_s={GRACE_S}",
             "log.every=1", "checkpoint.async_save=false")
#: attempt 0's steps take this long, so a kill lands between the step-3 checkpoint and the end
SLOW = 'failure.faults="slow:ms=700"'


@pytest.fixture(scope="module")
def config(small_corpus, tmp_path_factory) -> Path:
    from shardwise.spec import spec_from_dict, spec_to_toml
    from tests.support.specs import tiny_spec_dict

    tmp = tmp_path_factory.mktemp("node-loss")
    path = tmp / "job.toml"
    data = tiny_spec_dict(small_corpus, tmp / "unused", run={"determinism": "invariant"})
    path.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """Two "nodes" of one job on this machine; each node's output goes to a file."""

    def __init__(self, config: Path, run_dir: Path, *extra: str) -> None:
        self.config, self.run_dir = config, run_dir
        self.overrides = [*OVERRIDES, *extra, f'run.dir="{run_dir}"']
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.nodes: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def start(self, rank: int) -> None:
        log = self.run_dir.parent / f"{self.run_dir.name}-node{rank}-{len(self.logs)}.log"
        self.logs[rank] = log
        with log.open("w") as out:
            self.nodes[rank] = subprocess.Popen(
                [sys.executable, "-m", "shardwise", "launch", str(self.config), "--nnodes", "2",
                 "--nproc-per-node", "1", "--rdzv-endpoint", self.endpoint, "--node-rank",
                 str(rank), "--exec", *[a for o in self.overrides for a in ("--set", o)]],
                stdout=out, stderr=subprocess.STDOUT, text=True)

    def output(self, rank: int) -> str:
        return self.logs[rank].read_text()

    def wait(self, rank: int, timeout: float) -> int:
        return self.nodes[rank].wait(timeout=timeout)

    def wait_for_checkpoint(self, step: int, timeout: float = 120) -> None:
        meta = self.run_dir / "checkpoints" / f"step-{step:06d}" / "meta.json"
        deadline = time.monotonic() + timeout
        while not meta.exists():
            assert time.monotonic() < deadline, [self.output(r) for r in self.nodes]
            assert all(n.poll() is None for n in self.nodes.values()), \
                [self.output(r) for r in self.nodes]
            time.sleep(0.05)

    def kill_node(self, rank: int) -> None:
        """SIGKILL the node's launcher, agent and workers at once, as a lost machine."""
        _kill(_tree(self.nodes[rank].pid))
        self.nodes[rank].wait()

    def close(self) -> None:
        for node in self.nodes.values():
            if node.poll() is None:
                _kill(_tree(node.pid))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the agent runs in a session of its own, so a process group
    would miss it)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += parents.get(current, [])
    return found


def _agent_lines(output: str) -> str:
    """What the launcher and the agent said (the workers' lines carry a [rankN] prefix)."""
    return "\n".join(line for line in output.splitlines() if not line.startswith("[rank"))


def _losses(run_dir: Path) -> dict[int, float]:
    events = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {e["step"]: e["loss"] for e in events if e["kind"] == "step"}


@pytest.fixture(scope="module")
def normal_end(config, tmp_path_factory):
    """The job without a fault, to its end: the reference of the drills below."""
    job = Job(config, tmp_path_factory.mktemp("normal") / "run")
    try:
        job.start(0)
        job.start(1)
        codes = [job.wait(0, 200), job.wait(1, 200)]
    finally:
        job.close()
    return job, codes


def test_normal_end_every_agent_exits_0(normal_end):
    job, codes = normal_end
    assert codes == [0, 0], [job.output(0), job.output(1)]
    for rank in (0, 1):
        said = _agent_lines(job.output(rank))
        assert "Traceback" not in said and "frame #" not in said, said
        assert "RendezvousConnectionError" not in said and "rendezvous" not in said.lower() \
            .replace("--rdzv", ""), said
    assert len(_losses(job.run_dir)) == STEPS


def test_losing_a_node_without_the_store_is_survived(config, normal_end, tmp_path):
    from shardwise.data.ledger import audit

    job = Job(config, tmp_path / "run", SLOW)
    try:
        job.start(0)
        job.start(1)
        job.wait_for_checkpoint(3)
        job.kill_node(1)
        started = time.monotonic()
        job.start(1)  # the replacement: the same command on a new "machine"
        codes = [job.wait(0, 180), job.wait(1, 180)]
        recovered_s = time.monotonic() - started
    finally:
        job.close()
    assert codes == [0, 0], [job.output(0), job.output(1)]
    events = [json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["attempt"] == 1 and restart["resumed_from_step"] >= 3
    assert _losses(job.run_dir) == _losses(normal_end[0].run_dir)
    report = audit(job.run_dir)
    assert report.exact, report.problems
    print(f"node 1 lost after step 3; the job ended {recovered_s:.1f} s after its replacement "
          f"started, resumed from step {restart['resumed_from_step']}")


def test_losing_the_store_host_ends_the_others_in_one_paragraph(config, tmp_path):
    job = Job(config, tmp_path / "run", SLOW)
    try:
        job.start(0)
        job.start(1)
        job.wait_for_checkpoint(3)
        job.kill_node(0)  # node rank 0: is_host=true
        lost = time.monotonic()
        code = job.wait(1, STORE_TIMEOUT_S + 30)
        ended_s = time.monotonic() - lost
    finally:
        job.close()
    said = _agent_lines(job.output(1))
    assert code == 75, job.output(1)
    assert ended_s < STORE_TIMEOUT_S, ended_s
    assert "Traceback" not in said and "frame #" not in said, said
    errors = [line for line in said.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, said
    assert errors[0].startswith("error: the node hosting the rendezvous store "
                                f"({job.endpoint}) is gone")
    assert "the run resumes from the newest checkpoint" in errors[0]
    assert (job.run_dir / LOST_MARKER).exists()
    print(f"the store's node lost; the other agent ended {ended_s:.1f} s later, exit code {code}")
