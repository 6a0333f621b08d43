"""Preemption: a signal asks the run to stop; every rank stops after the same step, a checkpoint
is committed, and the run exits with `PREEMPTED_EXIT` so that a requeued job resumes from it.

A signal may reach only some ranks, or reach them during different steps (Slurm signals every
process of a step, torchrun's agent forwards its own signal, a user may `kill` one worker). So no
rank acts on its own flag: at every step boundary each rank contributes the signal number it saw
(0 for none) to an all-reduce MAX on a gloo group of its own, and all stop when the result is
non-zero. The all-reduce of step k is waited for at the end of step k+1, so its latency hides
behind a step and every rank still reads the same value: they stop after the same step.

Workers end a preempted run normally (exit 0), so that an elastic agent never counts it as a
failure to restart; the marker file RUN_DIR/preempted.json tells the launcher (`shardwise train`,
`shardwise launch --exec`, the sbatch script) to exit with PREEMPTED_EXIT instead.

This module imports no torch at module level: the spec validates `failure.preempt_signals`.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.spec.failure import parse_signals

#: EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry" — a preempted
#: run is complete up to its checkpoint and continues when re-launched.
PREEMPTED_EXIT = 75
MARKER = "preempted.json"
#: the marker's phase when the signal reached the launcher and not a worker's handler
LAUNCHER_PHASE = "launcher"


#: the signals torch's elastic agent handles by default
AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def agent_signals(preempt_signals: str) -> str:
    """What the elastic agent (torchrun's `--signals-to-handle`) must handle and forward to its
    workers: its defaults plus the preemption signals — SIGUSR1 would otherwise kill the agent
    and orphan the workers."""
    names = [*AGENT_SIGNALS, *(sig.name for sig in parse_signals(preempt_signals))]
    return ",".join(dict.fromkeys(names))


class SignalFlag:
    """The first preemption signal this process received (handlers only record it: all work
    happens at the next step boundary, in the training thread).

    Signal handlers belong to the process, so a process has one flag: `for_process` returns it,
    installing handlers for signals it does not handle yet. A worker's entry point takes it first
    (a signal while torch is imported is a preemption, not a kill), and the trainer later asks
    for the same flag with the spec's signals, keeping whatever it caught in between."""

    _process: SignalFlag | None = None  # the process's flag while its handlers are installed

    def __init__(self) -> None:
        self.signum = 0
        self.at: float | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @classmethod
    def for_process(cls, signals: tuple[signal.Signals, ...]) -> SignalFlag:
        """The process's flag, handling exactly `signals` from now on."""
        flag = cls._process or cls()
        for sig in [s for s in flag._previous if s not in signals]:  # the spec wants it fatal
            previous = flag._previous.pop(sig)
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        flag.install(tuple(s for s in signals if s not in flag._previous))
        cls._process = flag if flag._previous else None
        return flag

    def install(self, signals: tuple[signal.Signals, ...]) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (tests' threads)
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if SignalFlag._process is self:
            SignalFlag._process = None

    def _handle(self, signum: int, _frame: Any) -> None:
        if not self.signum:
            self.signum, self.at = signum, time.time()

    def raise_(self, sig: signal.Signals) -> None:
        """Record `sig` as if it had arrived (fault drills on one rank)."""
        self._handle(int(sig), None)


@dataclass
class Preemption:
    """Step-boundary agreement on stopping. `poll()` is a collective: every rank calls it once
    after every step."""

    flag: SignalFlag
    group: Any = None  # a gloo group of its own; None: one process, no agreement needed
    agreed: int = 0  # the signal number every rank agreed on (0: none)
    agreed_at: float | None = None
    _pending: Any = None  # (tensor, work) of the all-reduce issued at the previous boundary

    @classmethod
    def start(cls, signals_text: str, distributed: bool, timeout_s: float,
              flag: SignalFlag | None = None) -> Preemption:
        """Install the handlers (unless `flag`, installed when the worker started, already holds
        them and what they caught) and (distributed: collective) create the group."""
        if flag is None:
            flag = SignalFlag.for_process(parse_signals(signals_text))
        group = None
        if distributed and signals_text.strip():
            from shardwise.compat import side_group  # (torch: not at module level, see above)

            group = side_group("preemption", timeout_s)
        return cls(flag, group)

    def poll(self) -> bool:
        """True when every rank is to stop after the step just finished."""
        if self.agreed:
            return True
        seen = self.flag.signum if self.group is None else self._exchange()
        if seen:
            self.agreed, self.agreed_at = seen, time.time()
        return bool(seen)

    def _exchange(self) -> int:
        import torch
        import torch.distributed as dist

        seen = 0
        if self._pending is not None:
            tensor, work = self._pending
            work.wait()
            seen = int(tensor.item())
        self._pending = None
        if not seen:
            # on the group object itself: control traffic, not training communication, stays
            # out of the comm accounting and flight records (which tap torch.distributed's calls)
            tensor = torch.tensor([self.flag.signum], dtype=torch.int64)
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX
            self._pending = (tensor, self.group.allreduce([tensor], options))
        return seen

    def close(self, wait: bool = True) -> None:
        """Restore the previous signal handlers; with `wait`, first finish the all-reduce in
        flight (every rank issued the same ones; after a failure a peer may be gone)."""
        if self._pending is not None and wait:
            self._pending[1].wait()
        self._pending = None
        if not self.agreed:
            self.flag.uninstall()
        elif SignalFlag._process is self.flag:
            # a preempted worker keeps ignoring the signal's repeats until it exits, but the next
            # run in this process (verify's runs in turn) starts with a flag of its own
            SignalFlag._process = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else ""


def catch_early() -> SignalFlag:
    """A worker process's first act, before it imports torch (seconds): handle the default
    preemption signals, so one that arrives meanwhile is a preemption, not a kill. The spec's own
    set replaces them once it is read (`run.startup.install_flag`)."""
    from shardwise.spec.operations import FailureSection

    return SignalFlag.for_process(parse_signals(FailureSection().preempt_signals))


def write_marker(run_dir: Path, fields: dict[str, Any]) -> None:
    from shardwise.utils.files import atomic_write_text

    atomic_write_text(run_dir / MARKER, json.dumps(fields, indent=2))


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def clear_marker(run_dir: Path) -> None:
    (run_dir / MARKER).unlink(missing_ok=True)


def marker_message(run_dir: Path, marker: dict[str, Any]) -> str:
    """The one line a launcher prints for a preempted run."""
    again = f"continue with `shardwise train --resume {run_dir}` (exit code {PREEMPTED_EXIT})"
    if marker.get("step") is None and marker.get("phase") == LAUNCHER_PHASE:
        return (f"stopped by {marker['signal']}, which reached the launcher before the workers "
                "committed a checkpoint for it: the run continues from its newest checkpoint, "
                f"or from step 0 if it has none: {again}.")
    if marker.get("step") is None:  # before the first step: nothing could be saved
        return (f"preempted by {marker['signal']} during start-up ({marker.get('phase', '')}), "
                "before the first step: nothing was lost or saved; the run continues from its "
                f"newest checkpoint, or from step 0 if it has none: {again}.")
    if not marker.get("checkpoint"):
        return (f"preempted by {marker['signal']} after step {marker['step']}, with no checkpoint "
                "(checkpoint.enabled = false): the run starts again from its newest checkpoint, "
                f"or step 0: {again}.")
    return (f"preempted by {marker['signal']} after step {marker['step']}: checkpoint "
            f"{Path(marker['checkpoint']).name} committed {marker['seconds_to_commit']:.1f} s "
            f"after the stop was agreed; {again}.")
