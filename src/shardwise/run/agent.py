"""Start N local workers through torch's elastic agent — the engine behind torchrun — and say
why they failed when they do (a user error written by the workers, a hang report, a collective
mismatch read from the flight records, a preemption).

The rendezvous is `run.local_rendezvous`: one store on 127.0.0.1 and a free port, so parallel
jobs on one machine never collide on a port and nothing listens beyond this machine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise.resilience.preempt import (
    LAUNCHER_PHASE,
    PREEMPTED_EXIT,
    agent_signals,
    marker_message,
    read_marker,
    write_marker,
)
from shardwise.run import local_rendezvous
from shardwise.run.rundir import ERRORS_DIR


class WorkersFailed(Exception):
    """One or more workers exited non-zero; `exit_code` is 2 when all failed on a user error."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(WorkersFailed):
    """A preemption signal stopped the run after a committed checkpoint (exit code 75)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PREEMPTED_EXIT)


def check_preempted(run_dir: Path) -> None:
    """Raise Preempted when this launch's workers stopped on a preemption signal."""
    marker = read_marker(run_dir)
    if marker is not None:
        raise Preempted(marker_message(run_dir, marker))


def launch_local(run_dir: Path, nproc: int, resume: bool, max_restarts: int = 0,
                 worker_args: tuple[str, ...] = (), preempt_signals: str = "",
                 grace_s: float = 30.0, then: tuple[Path, ...] = ()) -> None:
    """Run `python -m shardwise.run.worker RUN_DIR` on `nproc` local workers and wait (with
    `then`, the workers train those fresh run directories after RUN_DIR, in the same launch). A
    preemption signal to this process is forwarded to the workers, which get `grace_s` to
    commit their checkpoint before the agent kills them."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # Our own message below names the failed ranks; the agent's log lines would repeat it.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend=local_rendezvous.BACKEND, rdzv_endpoint="",
        local_addr=local_rendezvous.LOOPBACK, max_restarts=max_restarts,
        monitor_interval=0.1, **_agent_signal_options(preempt_signals, grace_s),
    )
    args = ["-m", "shardwise.run.worker", str(run_dir), *map(str, then),
            *(["--resume"] if resume else []), *worker_args]
    errors = run_dir / ERRORS_DIR
    shutil.rmtree(errors, ignore_errors=True)
    try:
        elastic_launch(config, sys.executable)(*args)
    except SignalException as err:  # the agent forwarded it and waited for the workers
        check_preempted(run_dir)
        name = signal.Signals(err.sigval).name
        if err.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        # the workers committed nothing for it (it came before they could, or the save took
        # longer than failure.preempt_grace_s): still a preemption, resumable from what exists
        write_marker(run_dir, {"signal": name, "step": None, "checkpoint": None,
                               "phase": LAUNCHER_PHASE, "grace_s": grace_s})
        check_preempted(run_dir)
    except ChildFailedError as err:
        codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        messages = sorted({p.read_text() for p in errors.glob("rank-*.txt")})
        if messages:  # a user error, the same on every rank that saw it: say it once
            raise WorkersFailed(" ".join(messages), 2) from None
        diagnosis = explain_failure(run_dir, nproc)
        if diagnosis:
            print(f"\n{diagnosis}", file=sys.stderr, flush=True)
        raise WorkersFailed(
            f"training failed: {describe_exits(codes)}. The workers' own output is above; the "
            f"run directory {run_dir} keeps everything written so far: continue from its last "
            f"checkpoint with `shardwise train --resume {run_dir}`.", 1) from None
    finally:
        shutil.rmtree(errors, ignore_errors=True)


#: signals that mean the process crashed (in native code: torch, a collective library, an
#: extension), not that something stopped it
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")
#: what a worker killed by one of them is called, by the launcher and by the test harness (whose
#: conftest reruns a test once for this, and for nothing else)
NATIVE_CRASH = "a crash in native code"


def describe_exits(codes: dict[int, int]) -> str:
    """How each failed rank ended, in words: "rank 1 exit code 1", "rank 0 killed by SIGKILL",
    and for a crash where its stack was printed (a launched worker's faulthandler)."""
    parts, crashed = [], False
    for rank, code in sorted(codes.items()):
        if code >= 0:
            parts.append(f"rank {rank} exit code {code}")
            continue
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        crashed = crashed or name in CRASH_SIGNALS
        parts.append(f"rank {rank} killed by {name}")
    text = ", ".join(parts)
    if crashed:
        text += (f" ({NATIVE_CRASH}: torch, a collective library or an extension; the "
                 "crashed rank printed every thread's Python stack above, from the "
                 "\"Fatal Python error\" line)")
    return text


def _agent_signal_options(preempt_signals: str, grace_s: float) -> dict[str, object]:
    """LaunchConfig's signal fields where this torch has them (older ones read the env)."""
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    options: dict[str, object] = {}
    if "signals_to_handle" in fields:
        options["signals_to_handle"] = agent_signals(preempt_signals)
    else:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = agent_signals(preempt_signals)
    if "shutdown_timeout" in fields:
        options["shutdown_timeout"] = max(1, math.ceil(grace_s))
    return options


def explain_failure(run_dir: Path, world: int) -> str:
    """The hang report of the last attempt if a watchdog wrote one; otherwise a diagnosis of the
    ranks' flight records when they show a mismatch or a rank that fell behind (gloo aborts a
    process on a collective mismatch, so that rank could not say it). Written to
    RUN_DIR/diagnostics/attempt-N/hang-report.txt and appended to metrics.jsonl as a `hang`
    event. Empty when the records show nothing wrong with the collectives."""
    from shardwise.resilience.flight import read_all
    from shardwise.resilience.hang import REPORT, append_event, diagnose, latest_attempt_dir, save

    directory = latest_attempt_dir(run_dir)
    if directory is None:
        return ""
    if not (directory / REPORT).exists():
        flights = read_all(directory)
        diagnosis = diagnose(flights, world)
        if not flights or not diagnosis.diverged:
            return ""
        save(directory, diagnosis,
             diagnosis.text(f"FAILED: the workers of {directory.name} died; their flight "
                            "records show a collective problem."),
             max(f.step for f in flights))
    append_event(run_dir, directory, source="launcher")
    return (directory / REPORT).read_text()
