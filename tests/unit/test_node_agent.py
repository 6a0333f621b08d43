"""Which node hosts the rendezvous store, and what an agent says when that store is gone
(#26 item 10): the command lines carry `--rdzv-conf is_host=...` decided from the node rank, and
`shardwise.cluster.node` turns the store's loss into one paragraph and exit code 75, fed
synthetic exceptions raised where torch's agent raises them. The real drills (a node killed on
each side of the store, a normal end) are tests/e2e/test_node_loss.py."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from shardwise.cluster import node, slurm, torchrun
from shardwise.cluster.torchrun import Endpoint
from shardwise.errors import UserError
from shardwise.spec import spec_from_dict
from tests.support.specs import tiny_spec_dict


@pytest.fixture
def spec(tmp_path):
    return spec_from_dict(tiny_spec_dict(tmp_path / "corpus.txt", tmp_path / "run")).validate()


def _conf(argv: list[str]) -> str:
    return argv[argv.index("--rdzv-conf") + 1]


@pytest.mark.parametrize(("endpoint", "nnodes", "node_rank", "expected"), [
    ("127.0.0.1:29400", 2, 0, "is_host=true"),
    ("127.0.0.1:29400", 2, 1, "is_host=false"),
    ("node001:29400", 4, 3, "is_host=false"),
    ("node001:29400", 4, 0, "is_host=true"),
    ("node001:29400", 4, None, "is_host=false"),  # the endpoint names another machine
    ("127.0.0.1:29400", 1, None, "is_host=true"),  # one node hosts its own store
])
def test_command_line_says_which_node_hosts_the_store(spec, tmp_path, endpoint, nnodes,
                                                      node_rank, expected):
    argv = torchrun.node_command(spec, tmp_path / "run", nnodes=nnodes, nproc_per_node=1,
                                 endpoint=Endpoint.parse(endpoint), node_rank=node_rank,
                                 agent=torchrun.node_agent(tmp_path / "run"))
    assert _conf(argv) == expected
    assert argv[1:5] == ["-m", "shardwise.cluster.node", "--run-dir", str(tmp_path / "run")]
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and "--node-rank" not in argv


def test_nodes_on_one_machine_must_say_their_rank(spec, tmp_path):
    with pytest.raises(UserError, match=r"each would claim the rendezvous store: give each its "
                                        r"--node-rank \(0 for the one that hosts the store"):
        torchrun.node_command(spec, tmp_path, nnodes=2, nproc_per_node=1,
                              endpoint=Endpoint.parse("127.0.0.1:29400"), node_rank=None)


@pytest.mark.parametrize(("node_id", "expected"), [("0", "is_host=true"), ("1", "is_host=false")])
def test_slurm_task_of_node_0_hosts_the_store(spec, tmp_path, node_id, expected):
    script = slurm.render_script(spec, tmp_path / "run", slurm.SlurmJob(nodes=2, nproc_per_node=1),
                                 tmp_path)
    srun = next(line for line in script.splitlines() if line.lstrip().startswith("bash -c"))
    task = shlex.split(srun)[2].replace("exec ", "echo ")  # what each node's task runs
    env = {"SLURM_NODEID": node_id, "RUN_DIR": "/r", "HEAD": "n1", "PORT": "29401",
           "SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", task, "shardwise-node", "--resume", "/r"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert _conf(out) == expected and out[out.index("--rdzv-endpoint") + 1] == "n1:29401"
    assert out[-3:] == ["train", "--resume", "/r"] and "--run-dir" in out
    assert f'"$RUN_DIR/{node.LOST_MARKER}" ]' in script and "exit 75" in script


def _raise_in(function: str, err: BaseException) -> BaseException:
    """`err` as torch's agent raises it: from inside a function of that name."""
    def raiser() -> None:
        raise err

    raiser.__code__ = raiser.__code__.replace(co_name=function)
    try:
        raiser()
    except BaseException as caught:  # handed back to the test
        return caught
    raise AssertionError("unreachable")


def _store_lost() -> RendezvousConnectionError:
    error = RendezvousConnectionError("The connection to the C10d store has failed.")
    error.__cause__ = dist.DistNetworkError("Broken pipe")
    return error


def _run_node(monkeypatch, tmp_path, err: BaseException, is_host: str = "false",
              ) -> tuple[int, Path]:
    from torch.distributed import run as torch_run

    def fail(_options) -> None:
        raise err

    monkeypatch.setattr(torch_run, "run", fail)
    # what main sets for the agent it starts, put back after the test
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    code = node.main(["--run-dir", str(run_dir), "--nnodes", "2", "--nproc-per-node", "1",
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "node001:29400",
                      "--rdzv-conf", f"is_host={is_host}", "-m", "shardwise", "train", "x"])
    return code, run_dir


def _one_paragraph(err: str) -> str:
    assert err.startswith("error: ") and "Traceback" not in err and "frame #" not in err
    assert err.strip().count("\n") == 0, err
    return err


def test_store_lost_while_running_is_one_paragraph_and_exit_75(monkeypatch, tmp_path, capsys):
    code, run_dir = _run_node(monkeypatch, tmp_path, _raise_in("num_nodes_waiting",
                                                               _store_lost()))
    err = _one_paragraph(capsys.readouterr().err)
    assert code == node.RESUMABLE_EXIT == 75
    assert "the node hosting the rendezvous store (node001:29400) is gone" in err
    assert f"resumes from the newest checkpoint in the run directory {run_dir}" in err
    assert "Start the same command on every node again" in err
    assert "is gone" in (run_dir / node.LOST_MARKER).read_text()


def test_store_error_after_the_job_succeeded_is_silent_and_exit_0(monkeypatch, tmp_path,
                                                                     capsys):
    code, run_dir = _run_node(monkeypatch, tmp_path, _raise_in("shutdown", _store_lost()))
    assert code == 0 and capsys.readouterr().err == ""
    assert not (run_dir / node.LOST_MARKER).exists()


@pytest.mark.parametrize(("is_host", "expected"), [
    ("false", "could not reach the rendezvous store at node001:29400 within 60 s"),
    ("true", "this node hosts the rendezvous store (is_host=true) but could not listen on "
             "node001:29400 (Broken pipe)"),
])
def test_store_missing_at_start_is_one_paragraph_and_exit_1(monkeypatch, tmp_path, capsys,
                                                            is_host, expected):
    code, run_dir = _run_node(monkeypatch, tmp_path, _raise_in("_create_tcp_store", _store_lost()),
                              is_host=is_host)
    assert code == 1 and expected in _one_paragraph(capsys.readouterr().err)
    assert not (run_dir / node.LOST_MARKER).exists()


def test_rendezvous_timeout_is_resumable(monkeypatch, tmp_path, capsys):
    code, run_dir = _run_node(monkeypatch, tmp_path, RendezvousTimeoutError("deadline"))
    err = _one_paragraph(capsys.readouterr().err)
    assert code == 75 and "not every node of the job joined it in time" in err
    assert (run_dir / node.LOST_MARKER).exists()


def test_failed_workers_keep_torchruns_report_without_a_traceback(monkeypatch, tmp_path,
                                                                    capsys):
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file="")
    failed = ChildFailedError("shardwise", {0: failure})
    shutdown = _raise_in("shutdown", _store_lost())  # torch's finally: replaces the failure
    shutdown.__context__ = failed
    code, _ = _run_node(monkeypatch, tmp_path, shutdown)
    err = capsys.readouterr().err
    assert code == 1 and "exitcode  : 3" in err and "Traceback" not in err


def test_other_errors_are_not_taken_for_a_lost_store(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unrelated"):
        _run_node(monkeypatch, tmp_path, ValueError("unrelated"))


def test_the_launchers_message_names_how_each_rank_ended() -> None:
    from shardwise.run.agent import describe_exits

    assert describe_exits({1: 1}) == "rank 1 exit code 1"
    assert describe_exits({0: -9, 1: -15}) == "rank 0 killed by SIGKILL, rank 1 killed by SIGTERM"
    crashed = describe_exits({0: -11, 1: -15})
    assert crashed.startswith("rank 0 killed by SIGSEGV, rank 1 killed by SIGTERM (a crash in ")
    assert "Python stack above" in crashed
    assert describe_exits({0: -6}).startswith("rank 0 killed by SIGABRT (a crash")
    assert describe_exits({2: -200}) == "rank 2 killed by signal 200"
