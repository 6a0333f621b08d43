"""The little statistics a scorecard needs, with the rule each verdict uses.

A difference is called only when it is larger than twice its standard error, so that noise is
not reported as a result: for held-out loss the error comes from the spread between seeds (runs
of one side that differ only in `run.seed`, or a spread measured before and given as --noise);
for throughput from the spread between log windows (and between a side's runs).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

#: standard error of a median, relative to that of a mean, for normal samples (sqrt(pi/2))
MEDIAN_SE = math.sqrt(math.pi / 2)
#: a difference is significant when |delta| > K * its standard error
K = 2.0


@dataclass(frozen=True)
class Stat:
    """One figure of one side: the value per run, their mean and sample standard deviation."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def sd(self) -> float | None:
        return statistics.stdev(self.values) if self.n > 1 else None


def stat(values: list[float | None]) -> Stat | None:
    """A Stat of the runs that have the figure, or None when none has it."""
    present = tuple(v for v in values if v is not None and math.isfinite(v))
    return Stat(present) if present else None


def pooled_sd(groups: list[Stat]) -> tuple[float | None, int]:
    """The pooled sample standard deviation over groups with two runs or more, and its degrees
    of freedom (0 when no group has two runs)."""
    num = sum((g.n - 1) * (g.sd or 0.0) ** 2 for g in groups if g.n > 1)
    dof = sum(g.n - 1 for g in groups if g.n > 1)
    return (math.sqrt(num / dof), dof) if dof else (None, 0)


def median_se(values: list[float]) -> float | None:
    """Standard error of the median of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    return MEDIAN_SE * statistics.stdev(values) / math.sqrt(len(values))


def significant(delta: float, se: float | None) -> bool | None:
    """Whether |delta| exceeds K standard errors; None when the error is unknown."""
    if se is None:
        return None
    return abs(delta) > K * se


def combined_se(sigma: float | None, n_a: int, n_b: int) -> float | None:
    """Standard error of a difference of two means of n_a and n_b draws with spread sigma."""
    if sigma is None:
        return None
    return sigma * math.sqrt(1 / n_a + 1 / n_b)


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank, as the trainer's own percentiles are taken."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
