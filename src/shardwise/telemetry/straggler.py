"""Straggler detection from per-rank compute time.

Per-rank step time cannot show a straggler: collectives make every rank's step as long as the
slowest one's. Compute time can — the step time minus the time this rank spent with a collective
in flight (mostly waiting for the others). The straggler waits least, so its compute time stands
out. Compared with the lower median (with two ranks: the faster one), a rank above
`factor` x median for `windows` log windows in a row is named.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Straggler:
    rank: int
    ratio: float
    compute_s: float
    median_s: float

    def describe(self) -> str:
        return (f"rank {self.rank} is a straggler: {self.ratio:.1f}x the median compute time "
                f"per step ({self.compute_s * 1000:.0f} ms vs {self.median_s * 1000:.0f} ms)")


@dataclass
class StragglerDetector:
    factor: float
    windows: int
    _streak: dict[int, int] = field(default_factory=dict)

    def observe(self, compute_s_per_rank: list[float]) -> list[Straggler]:
        """One log window's median compute time per rank -> the ranks that are stragglers now."""
        if len(compute_s_per_rank) < 2:
            return []
        median = statistics.median_low(compute_s_per_rank)
        found = []
        for rank, value in enumerate(compute_s_per_rank):
            slow = median > 0 and value > self.factor * median
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if slow and self._streak[rank] >= self.windows:
                found.append(Straggler(rank, value / median, value, median))
        return found
