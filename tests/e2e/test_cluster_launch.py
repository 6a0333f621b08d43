"""`shardwise launch` and `shardwise status`: the torchrun command of a node, the Slurm script,
the checks that refuse a broken cluster job before anything starts, and (slow) two torchrun
agents on 127.0.0.1 as two nodes of one job, one node's worker killed and restarted."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.cluster import slurm
from shardwise.cluster.filesystems import check_shared, mount_of
from shardwise.cluster.torchrun import Endpoint
from shardwise.errors import UserError

MOUNTINFO = """\
22 1 0:21 / / rw - ext4 /dev/sda1 rw
30 22 0:25 / /dev/shm rw - tmpfs tmpfs rw
31 22 0:40 / /shared rw - nfs4 fs1:/export rw
32 31 0:41 / /shared/scratch\\040space rw - lustre 10.0.0.1@o2ib:/scratch rw
"""


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _fake_commands(tmp_path: Path, monkeypatch, **scripts: str) -> None:
    """Put shell scripts named after Slurm commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_node_command_is_the_exact_torchrun_line(capsys, tmp_path):
    run_dir = tmp_path / "run"
    code, out, _ = _cli(capsys, "launch", "--nnodes", "2", "--nproc-per-node", "4",
                        "--rdzv-endpoint", "127.0.0.1:29411", "--node-rank", "1",
                        "--set", f"run.dir={json.dumps(str(run_dir))}",
                        "--set", "failure.max_restarts=3", "--set", "failure.preempt_grace_s=45")
    assert code == 0
    argv = shlex.split(out)
    # torchrun's options, run by torchrun's agent in shardwise.cluster.node
    assert argv[:5] == [sys.executable, "-m", "shardwise.cluster.node", "--run-dir", str(run_dir)]
    options = dict(zip(argv[5:-4:2], argv[6:-4:2], strict=True))
    assert options == {"--nnodes": "2", "--nproc-per-node": "4",
                       "--rdzv-backend": "c10d", "--rdzv-endpoint": "127.0.0.1:29411",
                       "--rdzv-id": "shardwise-run", "--rdzv-conf": "is_host=false",
                       "--max-restarts": "3",
                       "--signals-to-handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                       "--shutdown-timeout": "45"}
    assert argv[-4:] == ["-m", "shardwise", "train", str(run_dir / "job.toml")]
    assert "max_restarts = 3" in (run_dir / "job.toml").read_text()
    (run_dir / "spec.toml").write_text("")  # a run started there: the command resumes it
    _, out, _ = _cli(capsys, "launch", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29411",
                     "--node-rank", "0", "--set", f"run.dir={json.dumps(str(run_dir))}",
                     "--set", "run.steps=99")
    assert "--rdzv-conf is_host=true" in out
    assert shlex.split(out)[-6:] == ["shardwise", "train", "--resume", str(run_dir), "--set",
                                     "run.steps=99"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--nnodes", "0", "--rdzv-endpoint", "h:1"], "needs at least one node"),
    (["--nnodes", "2", "--rdzv-endpoint", "node1"], "'node1' is not HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node1:70000"], "is not HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node1:29400"], "a multi-node launch needs run.dir"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--node-rank", "2"],
     "--node-rank 2 is outside 0..1"),
    (["--slurm", "--nodes", "0"], "needs at least one node"),
    (["--slurm", "--nodes", "1", "--time", "1:00", "--dry-run"], "not longer than"),
    (["--slurm", "--nodes", "1", "--time", "an hour", "--dry-run"], "not a Slurm time limit"),
])
def test_bad_cluster_input_is_one_paragraph_and_exit_2(argv, message, capsys, tmp_path,
                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _cli(capsys, "launch", *argv)
    assert code == 2 and err.startswith("error: ") and message in " ".join(err.split())
    assert not (tmp_path / "runs").exists()  # nothing written


def test_run_dir_other_nodes_cannot_see_is_refused():
    assert mount_of(Path("/shared/scratch space/run"), MOUNTINFO).fstype == "lustre"
    assert mount_of(Path("/shared/x"), MOUNTINFO).fstype == "nfs4"
    check_shared(Path("/shared/x/run"), 8, MOUNTINFO)
    check_shared(Path("/dev/shm/run"), 1, MOUNTINFO)  # one node: anything goes
    with pytest.raises(UserError, match=r"/dev/shm \(tmpfs: node-local memory"):
        check_shared(Path("/dev/shm/run"), 2, MOUNTINFO)
    with pytest.raises(UserError, match=r"other 3 nodes cannot see.*checkpoint.uri"):
        check_shared(Path("/home/me/run"), 4, MOUNTINFO)
    assert Endpoint.parse("[fe80::1]:29400") == Endpoint("fe80::1", 29400)
    assert Endpoint.parse("127.0.0.1:5").is_local and not Endpoint.parse("node7:5").is_local


def test_slurm_script_and_submission(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fake_commands(tmp_path, monkeypatch, sinfo="echo debug; echo gpu",
                   scontrol="exit 0", sbatch='echo "4242;cluster"')
    run_dir = tmp_path / "run"
    code, out, _ = _cli(capsys, "launch", "--slurm", "--nodes", "4", "--gpus-per-node", "8",
                        "--partition", "gpu", "--time", "2-00:00:00", "--account", "proj",
                        "--requeue", "--assume-shared", "--set", "failure.max_restarts=2",
                        "--set", "failure.preempt_grace_s=300",
                        "--set", f"run.dir={json.dumps(str(run_dir))}")
    assert code == 0 and "submitted Slurm job 4242" in out
    script = (run_dir / slurm.SCRIPT).read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive",
                 "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=2-00:00:00", "#SBATCH --account=proj",
                 "#SBATCH --requeue", "#SBATCH --signal=USR1@300",
                 'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 'scontrol requeue "$SLURM_JOB_ID"', "exit 75"):
        assert line in script.splitlines() or f"    {line}" in script.splitlines(), line
    assert '--rdzv-endpoint "$HEAD:$PORT"' in script and "--max-restarts 2" in script
    assert '--rdzv-conf "is_host=$IS_HOST"' in script
    assert "--nproc-per-node 8" in script and "--shutdown-timeout 300" in script
    assert json.loads((run_dir / slurm.JOB_RECORD).read_text())["job_id"] == "4242"
    result = subprocess.run(["bash", "-n", str(run_dir / slurm.SCRIPT)], capture_output=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("commands", "argv", "message"), [
    ({}, [], "sbatch, scontrol not found"),
    ({"sinfo": "echo debug", "scontrol": "true", "sbatch": "exit 9"}, ["--partition", "gpu"],
     "'gpu' is not a partition of this cluster (sinfo lists debug)"),
    ({"sinfo": "exit 1", "scontrol": "true",
      "sbatch": "echo 'sbatch: error: invalid account or account/partition combination' >&2; "
                "exit 1"}, ["--account", "nope"], "sbatch refused the job: sbatch: error: invalid"),
])
def test_refused_slurm_job_leaves_nothing_behind(commands, argv, message, capsys, tmp_path,
                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    if commands:
        _fake_commands(tmp_path, monkeypatch, **commands)
    else:  # no Slurm at all: a PATH without it
        monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    run_dir = tmp_path / "run"
    code, _, err = _cli(capsys, "launch", "--slurm", "--nodes", "1", *argv,
                        "--set", f"run.dir={json.dumps(str(run_dir))}")
    assert code == 2 and message in " ".join(err.split())
    assert not run_dir.exists()


def test_status_reports_slurm_state_and_last_step(capsys, tmp_path, monkeypatch):
    _fake_commands(tmp_path, monkeypatch, squeue='[ "$3" = 77 ] && echo RUNNING')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    slurm.record(run_dir, "77", run_dir / slurm.SCRIPT)
    events = [{"kind": "step", "step": 3, "loss": 4.25, "tokens_per_s": 1234.5,
               "samples_per_s": 2.5}, {"kind": "step", "step": 4, "loss": 4.0,
                                       "tokens_per_s": 2000.0, "samples_per_s": 3.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"ki')
    code, out, _ = _cli(capsys, "status", str(run_dir))
    assert code == 0
    assert out.splitlines()[1:] == ["slurm job 77: RUNNING",
                                    "last step 4: loss 4.0000, 2,000 tokens/s, 3.00 samples/s"]


# --- two "nodes" on one machine ------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> dict[int, float]:
    events = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {e["step"]: e["loss"] for e in events if e["kind"] == "step"}


@pytest.mark.slow  # two torchrun agents, a kill and an elastic restart: ~40 s
@pytest.mark.timeout(240)
def test_two_nodes_on_loopback_restart_after_a_killed_worker(small_corpus, tmp_path):
    """`shardwise launch --exec` on "node" 0 and 1 (c10d rendezvous on 127.0.0.1); one node's
    worker is SIGKILLed at step 5; both agents restart their workers, which resume from the
    step-3 checkpoint and end with the losses of an uninterrupted single-machine run, bit for
    bit, and an exact ledger."""
    from shardwise.data.ledger import audit
    from shardwise.spec import spec_from_dict, spec_to_toml
    from shardwise.verify.layouts import parse_layout
    from shardwise.verify.runner import layout_spec, run_layout
    from tests.support.specs import tiny_spec_dict

    config = tmp_path / "job.toml"
    data = tiny_spec_dict(small_corpus, tmp_path / "unused", run={"determinism": "invariant"})
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    reference = run_layout("ref", layout_spec(str(config), [], parse_layout("zero3-2"),
                                              tmp_path / "ref", steps=8)
                           .replace("checkpoint", enabled=True, every=3), tmp_path / "ref")

    run_dir = tmp_path / "two-nodes"
    overrides = ["run.steps=8", "checkpoint.enabled=true", "checkpoint.every=3",
                 "parallel.zero=3", "failure.max_restarts=1", "log.every=1",
                 # synchronous saves: the step-3 checkpoint is committed before the kill
                 "checkpoint.async_save=false",
                 'failure.faults="kill:rank=1:step=5:phase=backward"', f'run.dir="{run_dir}"']
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "shardwise", "launch", str(config), "--nnodes", "2",
         "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--node-rank", str(rank), "--exec",
         *[a for o in overrides for a in ("--set", o)]],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=200)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["attempt"] == 1 and restart["resumed_from_step"] == 3
    run_start = [e for e in events if e["kind"] == "run_start"]
    assert [e["world_size"] for e in run_start] == [2, 2]
    assert _losses(run_dir) == dict(enumerate(reference.losses, start=1))
    report = audit(run_dir)
    assert report.exact, report.problems
    assert (run_dir / "checkpoints" / "step-000008" / "meta.json").exists()
