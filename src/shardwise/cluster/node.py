"""`python -m shardwise.cluster.node --run-dir RUN_DIR TORCHRUN-OPTIONS -m shardwise train ...`:
one node's elastic agent, run by `shardwise launch --exec` and the Slurm job.

It is torchrun's own entry point (`torch.distributed.run.main`, same options, same agent), run in
this process so that what ends a multi-node job is said in one paragraph. torchrun itself, when
the node hosting the c10d rendezvous store is lost, dies with a RendezvousConnectionError
traceback under screens of C++ frames and exit code 1, which no requeue resumes from; and at the
normal end of a job, a node that does not host the store can log that error while the store's
host shuts down. Here:

- the store lost while the job runs (or the rendezvous timing out because a node never came
  back): one paragraph, exit code 75 (`RESUMABLE_EXIT`, what a preemption ends with: a relaunch
  or a Slurm requeue resumes from the newest checkpoint) and RUN_DIR/`LOST_MARKER`, which tells
  the sbatch script to requeue;
- the store unreachable at start (or its port taken): one paragraph, exit code 1;
- the store's connection error while the agents shut down after the job succeeded: nothing said,
  exit 0.

The module imports no torch until `main` runs (the sbatch script needs `LOST_MARKER`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from shardwise.resilience.preempt import PREEMPTED_EXIT

#: what a lost store (or a rendezvous no node can complete) exits with: EX_TEMPFAIL, the code a
#: preempted run ends with, so that a relaunch or a Slurm requeue resumes the run
RESUMABLE_EXIT = PREEMPTED_EXIT
#: written into the run directory by every agent that saw the store lost; the sbatch script
#: requeues when it finds it (its srun exit code is the killed node's, not ours)
LOST_MARKER = "rendezvous-lost.json"
#: the c10d store's read timeout when --rdzv-conf does not set one (torch's default)
DEFAULT_READ_TIMEOUT_S = 60
#: log lines torch's agent writes about a store that is gone; the paragraph says it once instead
_NOISE = ("RendezvousConnectionError", "keep-alive heartbeat", "failed to shutdown the rendezvous")
_LOGGERS = ("torch.distributed.elastic.agent.server.api",
            "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
            "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
            "torch.distributed.launcher.api")


@dataclass(frozen=True)
class Rendezvous:
    """Where this node's agent meets the others, as its torchrun options say."""

    endpoint: str
    is_host: bool | None  # None: left to torch's hostname match
    read_timeout_s: int

    @classmethod
    def from_options(cls, endpoint: str, rdzv_conf: str) -> Rendezvous:
        conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
        flag = conf.get("is_host", "").strip().lower()
        is_host = True if flag in ("1", "true", "t", "yes", "y") else \
            False if flag in ("0", "false", "f", "no", "n") else None
        timeout = conf.get("read_timeout", "")
        return cls(endpoint, is_host,
                   int(timeout) if timeout.isdigit() else DEFAULT_READ_TIMEOUT_S)


def store_error(err: BaseException | None) -> bool:
    """True when `err` (or what caused it) is the c10d store failing: a connection refused,
    reset or timed out."""
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    return err is not None and _in_chain(
        err, (RendezvousConnectionError, DistNetworkError, DistStoreError)) is not None


def _raised_in(err: BaseException, *functions: str) -> bool:
    return any(frame.name in functions for frame in traceback.extract_tb(err.__traceback__))


def _in_chain(err: BaseException,
              kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of `kind` among `err`, its causes and the exceptions it was raised
    while handling (torch's `finally` can replace a workers' failure with a store error)."""
    todo, seen = [err], set()
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return None


def explain(err: BaseException, where: Rendezvous, run_dir: Path | None) -> tuple[str, int]:
    """The paragraph and exit code for an agent that ended on `err`; ("", 0) when it ended
    after the job succeeded (the store's host shut down first), ("", -1) when `err` is not
    about the rendezvous (torch's own report stands)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    run = f"the run directory {run_dir}" if run_dir else "the run directory"
    again = (f"Start the same command on every node again (a Slurm job submitted with --requeue "
             f"requeues itself): the run resumes from the newest checkpoint in {run} "
             f"(exit code {RESUMABLE_EXIT}).")
    if isinstance(err, RendezvousTimeoutError) or _in_chain(err, RendezvousTimeoutError):
        return (f"the rendezvous at {where.endpoint} timed out: not every node of the job joined "
                "it in time (a node was lost and nothing started it again, or one never "
                f"started), so this node stopped its workers. {again}", RESUMABLE_EXIT)
    if not store_error(err):
        return "", -1
    if _raised_in(err, "_create_tcp_store", "create_backend"):  # at start: no store yet
        if where.is_host:
            return (f"this node hosts the rendezvous store (is_host=true) but could not listen "
                    f"on {where.endpoint} ({_root_message(err)}): another job may hold the port. "
                    "Give every node another free port in --rdzv-endpoint (Slurm: --rdzv-port) "
                    "and launch again.", 1)
        return (f"could not reach the rendezvous store at {where.endpoint} within "
                f"{where.read_timeout_s} s: the node that hosts it (the node the endpoint names, "
                "launched with --node-rank 0) is not running, or the endpoint is wrong or "
                "blocked by a firewall. Start node rank 0 first, check that this node can reach "
                "that address and port, and launch this node again.", 1)
    if _raised_in(err, "shutdown", "_exit_barrier"):
        return "", 0  # after the workers ended: the store's host finished first
    return (f"the node hosting the rendezvous store ({where.endpoint}) is gone: this node lost "
            "its connection to the store while the job ran, and no node can rejoin a job "
            "without it, so this node stopped its workers. " + again, RESUMABLE_EXIT)


def _root_message(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return " ".join(str(err).split("\n", 1)[0].split()) or type(err).__name__


def write_lost_marker(run_dir: Path, message: str) -> None:
    from shardwise.utils.files import atomic_write_text

    with contextlib.suppress(OSError):  # the exit code says it too
        atomic_write_text(run_dir / LOST_MARKER, json.dumps(
            {"message": message, "time": time.time(), "host": os.uname().nodename}, indent=2))


class _StoreNoise(logging.Filter):
    """Drops what torch's agent logs about the store being gone (the paragraph says it once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and store_error(record.exc_info[1]):
            return False
        return not any(text in record.getMessage() for text in _NOISE)


def _import_torch_quietly() -> None:
    """Import torch with its C++ log off in this process only: a lost or unreachable store makes
    c10d's TCPStore print each failed send or connect with its C++ stack, which the paragraph
    says once. The workers inherit the user's setting."""
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = previous or "FATAL"
    try:
        import torch  # noqa: F401  (c10's log level is read once, here)
    finally:
        if previous is None:
            del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dir = None
    if argv[:1] == ["--run-dir"] and len(argv) > 1:
        run_dir, argv = Path(argv[1]), argv[2:]
    _import_torch_quietly()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from shardwise.cluster import rendezvous

    options = torchrun.parse_args(argv)
    where = Rendezvous.from_options(options.rdzv_endpoint, options.rdzv_conf)
    if options.rdzv_backend == "c10d":
        # the workers' store is the rendezvous store (cluster.rendezvous); rank 0 of a round
        # then needs no store of its own, which would be one more unauthenticated listener
        options.rdzv_backend = rendezvous.BACKEND
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _StoreNoise) for f in logger.filters):
            logger.addFilter(_StoreNoise())
    try:
        torchrun.run(options)
    except SignalException as err:  # the agent stopped its workers; the launcher says why
        return 128 + int(err.sigval)
    except Exception as err:
        failed = _in_chain(err, ChildFailedError)
        if failed is not None:  # the workers failed: torchrun's report, without a traceback
            print(str(failed), file=sys.stderr, flush=True)
            return 1
        message, code = explain(err, where, run_dir)
        if code < 0:
            raise
        if message:
            if code == RESUMABLE_EXIT and run_dir is not None:
                write_lost_marker(run_dir, message)
            print(f"error: {message}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
