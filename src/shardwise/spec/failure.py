"""The grammars of the [failure] section's strings — fault lists (`failure.faults`) and signal
lists (`failure.preempt_signals`) — parsed here, in the torch-free spec layer, so a typo is
refused before any worker starts; `resilience.faults` and `resilience.preempt` act on what
these return. The fault grammar is described in `shardwise.resilience.faults`."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from shardwise.errors import SpecError, show

KINDS = ("kill", "crash", "raise", "hang", "slow", "nan", "corrupt", "mismatch", "signal")
PHASES = ("startup", "data", "forward", "backward", "optimizer", "checkpoint-write")


#: what schedulers and people send to ask a job to stop (Slurm --signal, SGE -notify, LSF, PBS,
#: Flux's time limit, Kubernetes, a UPS): the only signals a preemption may be declared on
PREEMPTION_SIGNALS = tuple(name for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                             "SIGUSR2", "SIGXCPU", "SIGALRM", "SIGPWR")
                           if hasattr(signal.Signals, name))
#: why another signal must not count as a preemption
_CHILD = "a process gets it each time a child process (such as `git`) exits, so every launch " \
    "would stop as preempted"
_CRASH = "it reports a crash, which must not be checkpointed as if the job were preempted"
_WHY_NOT = {"SIGCHLD": _CHILD, "SIGCLD": _CHILD,
            **dict.fromkeys(("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGIOT",
                             "SIGTRAP", "SIGSYS"), _CRASH)}
_OTHER = ("a process gets it for reasons of its own (pipes, the terminal, job control, "
          "profilers, I/O), so launches would stop as preempted for no reason")


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """`"SIGTERM,SIGUSR1"` (or `"TERM, USR1"`) as signals; "" is none. Only signals that ask a job
    to stop (`PREEMPTION_SIGNALS`) are accepted: another that this process gets for its own
    reasons, or one that means a crash, would turn ordinary events into preemptions."""
    found = []
    for name in filter(None, (part.strip().upper() for part in text.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise SpecError(f"failure.preempt_signals: {show(name, 30)} is not a signal that can "
                            "be caught; list names such as \"SIGTERM,SIGUSR1\" (\"\" disables "
                            "preemption handling).")
        if sig.name not in PREEMPTION_SIGNALS:
            raise SpecError(
                f"failure.preempt_signals: {sig.name} is not a preemption signal: "
                f"{_WHY_NOT.get(sig.name, _OTHER)}. List signals a scheduler "
                f"sends to ask a job to stop: {', '.join(PREEMPTION_SIGNALS)} (e.g. "
                "\"SIGTERM,SIGUSR1\"; \"\" disables preemption handling).")
        found.append(sig)
    return tuple(found)


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    phase: str | None = None
    ms: float = 0.0
    attempt: int = 0
    sig: str = "SIGTERM"  # the `signal` kind's signal

    def matches(self, rank: int, step: int, phase: str | None, attempt: int) -> bool:
        return (self.attempt == attempt and (self.rank is None or self.rank == rank)
                and (self.step is None or self.step == step)
                and (self.phase is None or phase is None or self.phase == phase))


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split(":")
        if kind not in KINDS:
            raise SpecError(f"failure.faults: unknown fault kind {show(kind, 30)} in {show(item)}; "
                            f"choose one of {', '.join(KINDS)} (e.g. kill:rank=1:step=3:phase=backward).")
        values: dict[str, object] = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key in ("rank", "step", "attempt", "ms"):
                values[key] = _number(key, value, item)
            elif key == "phase":
                if value not in PHASES:
                    raise SpecError(f"failure.faults: unknown fault phase {show(value, 30)} in "
                                    f"{show(item)}; choose one of {', '.join(PHASES)}.")
                values[key] = value
            elif key == "sig":
                values[key] = parse_signals(value)[0].name if value else "SIGTERM"
            else:
                raise SpecError(f"failure.faults: unknown fault option {show(key, 30)} in "
                                f"{show(item)}; use rank, step, phase, ms, attempt or sig.")
        faults.append(Fault(kind, **values))  # type: ignore[arg-type]
    return faults


_LOWEST = {"rank": 0, "step": 1, "attempt": 0, "ms": 0}  # steps are 1-based


def _number(key: str, value: str, item: str) -> int | float:
    """rank, step and attempt are whole numbers, ms a finite number of milliseconds; none is
    below `_LOWEST` (a fault that can never fire, or a sleep of nan ms, is a typo to report)."""
    try:
        number: int | float = float(value) if key == "ms" else int(value)
    except ValueError:
        raise SpecError(f"failure.faults: {key}={show(value, 30)} in {show(item)} is not a "
                        "number; write e.g. rank=1, step=3, ms=200.") from None
    if (isinstance(number, float) and not math.isfinite(number)) or number < _LOWEST[key]:
        raise SpecError(f"failure.faults: {key}={show(value, 30)} in {show(item)} must be a "
                        f"{'finite number' if key == 'ms' else 'whole number'} of at least "
                        f"{_LOWEST[key]}.")
    return number
