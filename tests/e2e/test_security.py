"""#26 "nobody in": a local `shardwise train --nproc 2` listens on loopback only (the launcher's
store and every worker's gloo sockets), and every file it writes has the mode the umask gives."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import write_toml
from tests.support.sockets import Listener, listeners, process_tree
from tests.support.specs import tiny_spec_dict

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")

UMASK = 0o002  # not the usual 022, so a file that ignores the umask shows


@dataclass
class LocalRun:
    run_dir: Path
    sockets: list[Listener]
    returncode: int
    stderr: str


def _routed_interface() -> str | None:
    """The interface of the default route (another machine reaches this one through it)."""
    for line in Path("/proc/net/route").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == "00000000":
            return fields[0]
    return None


def _step_logged(run_dirs: list[Path]) -> bool:
    for run_dir in run_dirs:
        try:
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            continue
        if any(json.loads(line).get("kind") == "step" for line in lines if line.endswith("}")):
            return True
    return False


def _run_and_listen(argv: list[str], cwd: Path, run_dirs, umask: int = 0o022) -> LocalRun:
    """Run `shardwise ARGV`; when a step is logged in one of `run_dirs()` (a run of several
    workers, whose step 2 sleeps), list the listening sockets of its processes. The environment
    names the machine's routed interface for gloo (GLOO_SOCKET_IFNAME), as a cluster's often
    does, so gloo's choice is tested even where the host name resolves to 127.0.0.1."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    interface = _routed_interface()
    if interface:  # a single-node run must not use it
        env["GLOO_SOCKET_IFNAME"] = interface
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            umask=umask)
    sockets: list[Listener] = []
    try:
        deadline = time.monotonic() + 120
        while not _step_logged(run_dirs()) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step logged in 120 s"
            time.sleep(0.05)
        if proc.poll() is None:
            sockets = listeners(process_tree(proc.pid))
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return LocalRun(cwd, sockets, proc.returncode, stderr)


def _assert_loopback_only(run: LocalRun) -> None:
    assert run.returncode == 0, run.stderr
    assert run.sockets, "no listening socket found while the run was alive"
    pids = {s.pid for s in run.sockets}
    assert len(pids) == 3, [str(s) for s in run.sockets]  # the launcher and both workers
    exposed = [str(s) for s in run.sockets if not s.loopback]
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.fixture(scope="module")
def local_run(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> LocalRun:
    """`shardwise train` on 2 workers whose step 2 sleeps 2 s on every rank: its sockets are
    listed then, while the launcher and both workers are alive with every process group made."""
    tmp = tmp_path_factory.mktemp("local-run")
    run_dir = tmp / "run"
    # parallel.timeout_s at its upper bound: the bound itself must work in every worker
    config = write_toml(tmp / "job.toml", tiny_spec_dict(
        small_corpus, run_dir, run={"steps": 3}, checkpoint={"enabled": True},
        parallel={"nproc": 2, "timeout_s": 604800.0},
        failure={"faults": "slow:step=2:ms=2000"}))
    run = _run_and_listen(["train", str(config)], tmp, lambda: [run_dir], umask=UMASK)
    run.run_dir = run_dir
    return run


@pytest.mark.grid  # reads `local_run` (18 s of set-up)
@pytest.mark.timeout(200)
def test_a_local_run_listens_on_loopback_only(local_run: LocalRun) -> None:
    """The launcher's rendezvous store and the workers' gloo groups: every listening socket of
    the run's processes is bound to 127.0.0.1 or ::1 (before: the agent's two TCPStores on
    *:PORT, the workers' gloo sockets on the address the host name resolves to)."""
    _assert_loopback_only(local_run)


@pytest.mark.slow  # ~30 s: verify trains the reference in-process, then the 2-worker layout
@pytest.mark.timeout(300)
def test_verify_launches_listen_on_loopback_only(small_corpus: Path, tmp_path: Path) -> None:
    """`shardwise verify`'s multi-worker launch goes through the same local launch."""
    config = write_toml(tmp_path / "job.toml", tiny_spec_dict(
        small_corpus, tmp_path / "unused", failure={"faults": "slow:step=2:ms=2000"}))
    out = tmp_path / "verify"
    run = _run_and_listen(["verify", str(config), "--layouts", "dp1,zero3-2", "--steps", "3",
                           "--out", str(out)], tmp_path,
                          lambda: [d for d in out.glob("*") if "zero3" in d.name])
    _assert_loopback_only(run)


@pytest.mark.grid  # reads `local_run` (18 s of set-up)
@pytest.mark.timeout(200)
def test_every_file_a_run_writes_follows_the_umask(local_run: LocalRun) -> None:
    """spec.toml, the manifests, meta.json, traces (atomic writes, before 0600) and the shards
    alike: 0o666 & ~umask for files, 0o777 & ~umask for folders."""
    assert local_run.returncode == 0, local_run.stderr
    wrong = []
    for path in [local_run.run_dir, *local_run.run_dir.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        want = (0o777 if path.is_dir() else 0o666) & ~UMASK
        if mode != want:
            wrong.append(f"{path.relative_to(local_run.run_dir)} {oct(mode)} (want {oct(want)})")
    assert (local_run.run_dir / "checkpoints" / "step-000003" / "meta.json").is_file()
    assert not wrong, wrong
