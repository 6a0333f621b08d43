"""A comparison of runs: their sides, whether they may be compared, the scorecard and the verdict.

Runs that differ only in `run.seed` form one side (their spread is the seed noise); sides are
ordered as their first run was given, and the first is the baseline every other side is judged
against. The comparison is controlled when every difference between sides, and within a side,
is infrastructure or explicitly allowed; only then is a winner named.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardwise.compare.fields import OTHER, SEED, Difference, differences, group_key, is_allowed
from shardwise.compare.figures import RunFigures, figures_of
from shardwise.compare.rows import (
    Noise,
    Row,
    cost_rows,
    plain_rows,
    quality_row,
    speed_of,
    target_rows,
    throughput_row,
)
from shardwise.compare.runs import RunData
from shardwise.compare.stats import pooled_sd, stat

UNRECORDED, MISSING_SPEC = "spec", "no spec.toml"


@dataclass
class Side:
    label: str  # A, B, C, ...
    runs: list[RunData]
    figures: list[RunFigures] = field(default_factory=list)

    @property
    def seeds(self) -> list[object]:
        return sorted({r.seed for r in self.runs}, key=repr)

    @property
    def layout(self) -> str:
        f = self.runs[0].facts
        return " ".join(str(v) for v in (f.get("topology.layout"), f.get("run.precision")) if v)


@dataclass
class Comparison:
    sides: list[Side]
    differences: list[Difference]  # between sides (values: one per side)
    within: list[tuple[str, Difference]]  # within a side (values: one per run)
    target_loss: float | None
    noise: Noise
    equal_tokens: float | None
    rows: list[Row]
    price: float | None
    notes: list[str] = field(default_factory=list)

    @property
    def blocking(self) -> list[Difference]:
        return [d for d in self.differences if d.blocks] + [d for _, d in self.within if d.blocks]

    @property
    def controlled(self) -> bool:
        return not self.blocking

    def pair_blocking(self, i: int) -> list[Difference]:
        """What keeps side i from a controlled comparison with the baseline: differences between
        the two, or within either, that are not infrastructure and not allowed."""
        pair = {self.sides[0].label, self.sides[i].label}
        return ([d for d in self.differences if d.blocks and (
                    d.values[0] != d.values[i] or (d.name == UNRECORDED and MISSING_SPEC in
                                                   (d.values[0], d.values[i])))]
                + [d for label, d in self.within if d.blocks and label in pair])

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    @property
    def verdicts(self) -> list[str]:
        """One sentence per non-baseline side."""
        return [verdict(self, i) for i in range(1, len(self.sides))]


def group_sides(runs: list[RunData]) -> list[Side]:
    groups: dict[tuple, Side] = {}
    for run in runs:
        key = group_key(run.facts, str(run.path))
        if key not in groups:
            groups[key] = Side(_label(len(groups)), [])
        groups[key].runs.append(run)
    return list(groups.values())


def _label(i: int) -> str:
    letters = string.ascii_uppercase
    return letters[i] if i < len(letters) else f"S{i + 1}"


def compare_runs(runs: list[RunData], allow: Sequence[str] = (), target_loss: float | None = None,
                 noise: float | None = None, price: float | None = None) -> Comparison:
    """Group, check and score `runs`. `target_loss`/`price` default to the baseline's spec
    (`eval.target_loss`, `telemetry.price_per_device_hour`; 0 there means none); `noise` is a
    seed-to-seed standard deviation of held-out loss measured elsewhere."""
    sides = group_sides(runs)
    base = sides[0].runs[0].facts
    target = target_loss if target_loss is not None else (base.get("eval.target_loss") or None)
    price = price if price is not None else (base.get("telemetry.price_per_device_hour") or None)
    allow = list(allow)
    across = differences([s.runs[0].facts for s in sides], allow)
    across += _seed_difference(sides, allow) + _unrecorded(sides)
    within = [(s.label, d) for s in sides if len(s.runs) > 1
              for d in differences([r.facts for r in s.runs], allow) if d.name != "run.seed"]
    for side in sides:
        side.figures = [figures_of(r, target) for r in side.runs]
    figures = [side.figures for side in sides]
    tokens = equal_tokens(figures)
    estimate = noise_estimate(figures, tokens, noise)
    rows = [r for r in (quality_row(figures, tokens, estimate),) if r is not None]
    rows += target_rows(figures, target, [speed_of(side) for side in figures])
    rows += [r for r in (throughput_row(figures),) if r is not None]
    rows += plain_rows(figures) + cost_rows(figures, price)
    comparison = Comparison(sides, across, within, target, estimate, tokens, rows, price)
    comparison.notes += _notes(comparison, figures)
    return comparison


def _seed_difference(sides: list[Side], allow: Sequence[str]) -> list[Difference]:
    """Seeds are not a confound, but sides with other seeds are listed (kind "seed")."""
    seeds = [s.seeds for s in sides]
    if all(s == seeds[0] for s in seeds[1:]):
        return []
    return [Difference("run.seed", [", ".join(map(str, s)) for s in seeds], SEED,
                       allowed=is_allowed("run.seed", allow))]


def _unrecorded(sides: list[Side]) -> list[Difference]:
    """A run without spec.toml cannot be shown to be the same job: a blocking difference."""
    have = ["spec.toml" if all(r.spec for r in s.runs) else MISSING_SPEC for s in sides]
    if MISSING_SPEC not in have:
        return []
    return [Difference(UNRECORDED, have, OTHER)]


def equal_tokens(sides: list[list[RunFigures]]) -> float | None:
    """The largest token count at which every run has a held-out evaluation."""
    common: set[float] | None = None
    for f in (f for side in sides for f in side):
        points = {p.tokens for p in f.evals if p.tokens is not None}
        common = points if common is None else common & points
    return max(common) if common else None


def noise_estimate(sides: list[list[RunFigures]], tokens: float | None,
                   given: float | None) -> Noise:
    """The seed spread: --noise when given, else pooled over the sides with several seeds."""
    measured: tuple[float | None, int] = (None, 0)
    if tokens is not None:
        stats = [s for side in sides if (s := stat([next((p.loss for p in f.evals
                                                           if p.tokens == tokens), None)
                                                     for f in side])) is not None]
        measured = pooled_sd(stats)
    if given is not None:
        extra = (f"; measured here: {measured[0]:.4f} over {measured[1]} degrees of freedom"
                 if measured[0] is not None else "")
        return Noise(given, f"given (--noise {given:g}){extra}")
    if measured[0] is not None:
        return Noise(measured[0], f"measured: pooled sd between seeds, {measured[1]} degrees "
                                  "of freedom")
    return Noise(None, "unknown: one run per side (run several seeds, or give --noise)")


def _notes(c: Comparison, figures: list[list[RunFigures]]) -> list[str]:
    notes = []
    if c.equal_tokens is None:
        notes.append("no token count at which every run has a held-out evaluation: held-out "
                     "loss is not compared (set eval.every so the runs evaluate at the same steps)")
    if c.target_loss is None:
        notes.append("no target loss: set eval.target_loss in the spec or pass --target-loss "
                     "for time and tokens to target")
    measured = {f.energy_source for side in figures for f in side}
    if measured == {""}:
        reasons = {f.energy_note for side in figures for f in side if f.energy_note}
        notes.append("energy: not measurable here" + (f" ({'; '.join(sorted(reasons))})"
                                                      if reasons else " (the runs recorded none)"))
    if not c.price:
        notes.append("no price per device-hour: cost is not shown (telemetry."
                     "price_per_device_hour, or --price)")
    return notes


def verdict(c: Comparison, i: int) -> str:
    """The sentence for side i against the baseline: quality first (a side that is worse beyond
    seed noise loses whatever its speed), then speed — time to target where both reached it,
    else throughput."""
    a, b = c.sides[0].label, c.sides[i].label
    blocking = c.pair_blocking(i)
    if blocking:
        names = sorted({d.name for d in blocking})
        return (f"{b} vs {a}: no winner called — the runs differ in {', '.join(names[:6])}"
                f"{' …' if len(names) > 6 else ''}, which is not infrastructure (--allow FIELD "
                "to compare anyway, knowingly)")
    quality = c.row("heldout_loss")
    q = quality.verdicts[i] if quality else "not compared (no common evaluation)"
    speed, why = _speed(c, i)
    said = f"held-out loss {q}; {why}"
    if q.startswith("worse"):
        return f"{b} vs {a}: {a} wins — {said}"
    if q.startswith("better"):
        return (f"{b} vs {a}: {b} wins — {said}" if speed != "slower"
                else f"{b} vs {a}: a trade-off, no winner — {said}")
    if speed == "none":
        return f"{b} vs {a}: no significant difference — {said}"
    winner = b if speed == "faster" else a
    judged = q.startswith(("identical", "within"))
    return (f"{b} vs {a}: {winner} wins — {said}" if judged else
            f"{b} vs {a}: {winner} is faster, quality not judged — {said}")


def _speed(c: Comparison, i: int) -> tuple[str, str]:
    """("faster" | "slower" | "none", what decided it) for side i against the baseline: time to
    target where both reached it and it could be judged, else throughput."""
    time = c.row("time_to_target")
    said = ""
    if time is not None and time.stats[0] is not None and time.stats[i] is not None \
            and time.texts[0] is None and time.texts[i] is None:
        v = time.verdicts[i]
        if not v.startswith("not separable"):
            state = "faster" if v.startswith("faster") else "slower" if v.startswith("slower") \
                else "none"
            return state, f"time to target {v}"
        said = f"time to target {v}; "
    tput = c.row("tokens_per_s")
    if tput is None or tput.stats[0] is None or tput.stats[i] is None:
        return "none", said + "throughput not recorded"
    v = tput.verdicts[i]
    state = v if v in ("faster", "slower") else "none"
    return state, said + f"throughput {tput.relative(i) or 0.0:+.1%} ({v})"


__all__ = ["OTHER", "Comparison", "Side", "compare_runs", "group_sides", "verdict"]
