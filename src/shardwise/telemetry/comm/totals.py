"""The tap's tallies: calls, bytes, wire bytes and time per "op:axis", per step and for the run.

The in-flight time of a step — its complement is compute time, which the straggler detector
compares — is the union of its calls' intervals: host intervals for host-timed calls, device
intervals (relative to the step's first device event) for device-timed ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OpTotals:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0  # bytes this rank sends if the collective runs as a ring
    time_s: float = 0.0

    def add(self, calls: int, nbytes: int, wire: float, seconds: float) -> None:
        self.calls += calls
        self.bytes += nbytes
        self.wire_bytes += wire
        self.time_s += seconds


@dataclass
class StepComm:
    """One step's communication on this rank: totals by "op:axis", and the time during which at
    least one collective was in flight (its complement in the step is compute). Device-timed calls
    fill in when their events resolve, possibly after the step ended (`resolved` says when all
    have)."""

    by_op: dict[str, OpTotals] = field(default_factory=dict)
    host_inflight_s: float = 0.0  # union of the host-timed calls' intervals, set at the step's end
    device_intervals: list[tuple[float, float]] = field(default_factory=list)  # resolved, seconds
    unresolved: int = 0  # device-timed calls whose completion has not been seen yet
    anchor: Any = None  # the step's first device event: device intervals are relative to it
    anchor_t: float = 0.0  # host clock when the anchor was recorded (places spans on the trace)

    @property
    def inflight_s(self) -> float:
        return self.host_inflight_s + _union_length(list(self.device_intervals), float("inf"))

    @property
    def resolved(self) -> bool:
        return self.unresolved == 0

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.by_op.values())

    @property
    def wire_bytes(self) -> float:
        return sum(t.wire_bytes for t in self.by_op.values())

    @property
    def time_s(self) -> float:
        return sum(t.time_s for t in self.by_op.values())


def _union_length(intervals: Iterable[list[float]], now: float) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted((s, min(e, now)) for s, e in intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total
