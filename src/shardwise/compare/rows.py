"""The scorecard's rows: one figure per row, one column per side, and for the headline rows
(held-out loss at equal tokens, tokens and time to target, throughput) a verdict per side
against the first (the baseline) that names the noise it was judged against."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from shardwise.compare.figures import RunFigures
from shardwise.compare.stats import (
    K,
    Stat,
    combined_se,
    median_se,
    percentile,
    pooled_sd,
    significant,
    stat,
)

Side = list[RunFigures]


@dataclass
class Row:
    key: str
    label: str
    unit: str  # how to format: loss, tokens, s, tokens/s, %, ratio, bytes, bytes/s, J, J/token, ...
    stats: list[Stat | None]
    better: str | None = None  # "lower" or "higher": the direction a reader wants
    verdicts: list[str] = field(default_factory=list)  # per side; the baseline's is ""
    texts: list[str | None] = field(default_factory=list)  # per side, shown instead of a number

    def delta(self, i: int) -> float | None:
        a, b = self.stats[0], self.stats[i]
        return None if a is None or b is None else b.mean - a.mean

    def relative(self, i: int) -> float | None:
        a, d = self.stats[0], self.delta(i)
        return None if d is None or a is None or a.mean == 0 else d / abs(a.mean)


@dataclass(frozen=True)
class Noise:
    """The seed-to-seed standard deviation of held-out loss the quality verdict uses."""

    sigma: float | None
    source: str


def quality_row(sides: list[Side], tokens: float | None, noise: Noise) -> Row | None:
    if tokens is None:
        return None
    stats = [stat([_loss_at(f, tokens) for f in side]) for side in sides]
    row = Row("heldout_loss", f"held-out loss at {tokens:,.0f} tokens", "loss", stats, "lower")
    row.verdicts = [""] + [_quality_verdict(stats[0], s, noise) for s in stats[1:]]
    return row


def _loss_at(f: RunFigures, tokens: float) -> float | None:
    return next((p.loss for p in f.evals if p.tokens == tokens), None)


def _quality_verdict(a: Stat | None, b: Stat | None, noise: Noise) -> str:
    if a is None or b is None:
        return "not evaluated at these tokens"
    delta = b.mean - a.mean
    if set(a.values) == set(b.values) and len(set(a.values)) == 1:
        return "identical"
    se = combined_se(noise.sigma, a.n, b.n)
    found = significant(delta, se)
    if found is None:
        return "no seed spread: give several seeds per side or --noise"
    if not found:
        return f"within seed noise (|Δ| ≤ {K:g}σ = {K * (se or 0):.4f})"
    return f"{'better' if delta < 0 else 'worse'} beyond seed noise ({K:g}σ = {K * (se or 0):.4f})"


def throughput_row(sides: list[Side]) -> Row | None:
    stats = [stat([_median(f.tokens_per_s) for f in side]) for side in sides]
    if all(s is None for s in stats):
        return None
    row = Row("tokens_per_s", "throughput (tokens/s, median window)", "tokens/s", stats, "higher")
    errors = [throughput_se(side) for side in sides]
    row.verdicts = [""] + [_speed_verdict(stats[0], s, errors[0], e, ("faster", "slower"))
                           for s, e in zip(stats[1:], errors[1:], strict=True)]
    return row


def speed_of(side: Side) -> tuple[float, float] | None:
    """A side's throughput (mean of its runs' medians) and standard error, where known."""
    medians = [m for f in side if (m := _median(f.tokens_per_s)) is not None]
    se = throughput_se(side)
    return (sum(medians) / len(medians), se) if medians and se is not None else None


def throughput_se(side: Side) -> float | None:
    """Standard error of a side's throughput: from its log windows, or from the spread between
    its runs when that is larger."""
    medians = [m for f in side if (m := _median(f.tokens_per_s)) is not None]
    window_ses = [se for f in side if (se := median_se(f.tokens_per_s)) is not None]
    if not medians:
        return None
    candidates = []
    if window_ses:
        candidates.append(math.sqrt(sum(se * se for se in window_ses)) / len(window_ses))
    if len(medians) > 1:
        candidates.append(Stat(tuple(medians)).sd / math.sqrt(len(medians)))  # type: ignore[operator]
    return max(candidates) if candidates else None


def _speed_verdict(a: Stat | None, b: Stat | None, se_a: float | None, se_b: float | None,
                   words: tuple[str, str]) -> str:
    if a is None or b is None:
        return ""
    se = math.hypot(se_a, se_b) if se_a is not None and se_b is not None else None
    found = significant(b.mean - a.mean, se)
    if found is None:
        return "no window spread to judge noise"
    if not found:
        return "within noise"
    return words[0] if b.mean > a.mean else words[1]


def target_rows(sides: list[Side], target: float | None,
                speed: list[tuple[float, float] | None]) -> list[Row]:
    """Tokens and seconds to the target loss. Where every run reached it at the same step, the
    time differs only by speed, so it is judged against the throughput's noise; otherwise
    against the seed spread of the figure itself. `speed`: each side's throughput and its
    standard error (None where unknown)."""
    if target is None:
        return []
    same_step = len({f.target.step if f.target else None for side in sides for f in side}) == 1
    rows = []
    for key, label, unit, get in (
            ("tokens_to_target", f"tokens to held-out loss {target:g}", "tokens",
             lambda f: f.target.tokens if f.target else None),
            ("time_to_target", f"time to held-out loss {target:g}", "s",
             lambda f: f.target.seconds if f.target else None)):
        stats = [stat([get(f) for f in side]) for side in sides]
        row = Row(key, label, unit, stats, "lower", texts=[_reached(side) for side in sides])
        row.verdicts = [""] + [_target_verdict(i, row, same_step, key, speed)
                               for i in range(1, len(sides))]
        rows.append(row)
    return rows


def _reached(side: Side) -> str | None:
    reached = sum(f.target is not None for f in side)
    if reached == len(side):
        return None
    best = min((f.best_loss for f in side if f.best_loss is not None), default=None)
    what = f"best {best:.4f}" if best is not None else "no evaluation"
    return "not reached" + (f" ({what})" if reached == 0 else f" by {len(side) - reached} of "
                            f"{len(side)} ({what})")


def _target_verdict(i: int, row: Row, same_step: bool, key: str,
                    speed: list[tuple[float, float] | None]) -> str:
    a, b = row.stats[0], row.stats[i]
    missed_a, missed_b = row.texts[0] is not None, row.texts[i] is not None
    if missed_a or missed_b:
        return {(True, True): "neither reached it", (True, False): "reached it (baseline did not)",
                (False, True): "worse: did not reach it"}[(missed_a, missed_b)]
    assert a is not None and b is not None
    if same_step and key == "tokens_to_target":
        return "equal (same evaluation step)"
    if same_step:  # time differs only by speed: its relative error is the throughput's
        sa, sb = speed[0], speed[i]
        se = (math.hypot(a.mean * sa[1] / sa[0], b.mean * sb[1] / sb[0])
              if sa is not None and sb is not None and sa[0] > 0 and sb[0] > 0 else None)
    else:
        sigma, _ = pooled_sd([s for s in (a, b) if s is not None])
        se = combined_se(sigma, a.n, b.n)
    found = significant(b.mean - a.mean, se)
    if found is None:
        return "not separable from seed noise (one run per side)"
    if not found:
        return "within noise"
    ratio = b.mean / a.mean if a.mean else math.inf
    return f"{'faster' if key == 'time_to_target' else 'fewer'} ({ratio:.2f}×)" \
        if b.mean < a.mean else f"{'slower' if key == 'time_to_target' else 'more'} ({ratio:.2f}×)"


#: rows without a verdict: (key, label, unit, better, figure)
PLAIN: tuple[tuple[str, str, str, str | None, Callable[[RunFigures], float | None]], ...] = (
    ("mfu", "MFU (median window)", "%", "higher", lambda f: _median(f.mfu)),
    ("step_p50", "step time p50", "s", "lower", lambda f: _median(f.step_time_s)),
    ("step_p99", "step time p99 (over windows)", "s", "lower",
     lambda f: _quantile(f.step_p99_s, 0.99)),
    ("straggler", "straggler tail (slowest rank / median)", "ratio", "lower",
     lambda f: f.straggler_ratio),
    ("peak_device", "peak device memory (allocated)", "bytes", "lower",
     lambda f: f.peak_device_bytes),
    ("peak_reserved", "peak device memory (reserved)", "bytes", "lower",
     lambda f: f.peak_reserved_bytes),
    ("peak_host", "peak host memory (RSS)", "bytes", "lower", lambda f: f.peak_host_bytes),
    ("comm_bytes", "communication per rank per step", "bytes", "lower", lambda f: f.comm_bytes),
    ("comm_time", "time in collectives per step", "s", "lower", lambda f: f.comm_time_s),
    ("comm_share", "communication share of step time", "%", "lower", lambda f: f.comm_share),
    ("ckpt_bandwidth", "checkpoint write bandwidth", "bytes/s", "higher",
     lambda f: f.checkpoint_bytes / f.checkpoint_write_s if f.checkpoint_write_s > 0 else None),
    ("ckpt_stall", "checkpoint stall per save", "s", "lower",
     lambda f: f.checkpoint_stall_s / f.checkpoints if f.checkpoints else None),
    ("restart", "restart time (to first step)", "s", "lower",
     lambda f: sum(f.restart_s) / len(f.restart_s) if f.restart_s else None),
    ("goodput", "goodput", "%", "higher", lambda f: f.goodput),
    ("training_time", "training time", "s", "lower", lambda f: f.training_s),
    ("startup", "start-up time", "s", "lower", lambda f: f.startup_s),
    ("energy", "energy (measured)", "J", "lower", lambda f: f.energy_j),
    ("energy_per_token", "energy per token", "J/token", "lower",
     lambda f: f.energy_j / f.tokens if f.energy_j is not None and f.tokens else None),
    ("energy_to_target", "energy to target", "J", "lower",
     lambda f: f.target.energy_j if f.target else None),
    ("device_hours", "device-hours", "h", "lower", lambda f: f.device_hours),
)


def plain_rows(sides: list[Side]) -> list[Row]:
    rows = []
    for key, label, unit, better, get in PLAIN:
        stats = [stat([get(f) for f in side]) for side in sides]
        if any(s is not None for s in stats):
            rows.append(Row(key, label, unit, stats, better))
    return rows


def cost_rows(sides: list[Side], price: float | None) -> list[Row]:
    """Device-hours times the price per device-hour, for the whole run and to the target."""
    if not price:
        return []
    rows = [Row("cost", f"cost at {price:g} per device-hour", "money",
                [stat([f.device_hours * price for f in side]) for side in sides], "lower")]
    to_target = [stat([f.target.device_hours * price if f.target else None for f in side])
                 for side in sides]
    if any(s is not None for s in to_target):
        rows.append(Row("cost_to_target", "cost to target", "money", to_target, "lower"))
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None
