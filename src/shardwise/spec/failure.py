"""The grammars of the [failure] section's strings — fault lists (`failure.faults`) and signal
lists (`failure.preempt_signals`) — parsed here, in the torch-free spec layer, so a typo is
refused before any worker starts; `resilience.faults` and `resilience.preempt` act on what
these return. The fault grammar is described in `shardwise.resilience.faults`."""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass

from shardwise.errors import SpecError, show

KINDS = ("kill", "raise", "hang", "slow", "nan", "corrupt", "mismatch", "signal")
PHASES = ("startup", "data", "forward", "backward", "optimizer", "checkpoint-write")


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """`"SIGTERM,SIGUSR1"` (or `"TERM, USR1"`) as signals; "" is none."""
    found = []
    for name in filter(None, (part.strip().upper() for part in text.split(","))):
        full = name if name.startswith("SIG") else f"SIG{name}"
        sig = getattr(signal.Signals, full, None)
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise SpecError(f"failure.preempt_signals: {show(name, 30)} is not a signal that can "
                            "be caught; list names such as \"SIGTERM,SIGUSR1\" (\"\" disables "
                            "preemption handling).")
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
