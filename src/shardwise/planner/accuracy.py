"""How sure a prediction is: the interval every GPU prediction carries, from how far the planner
was off on published runs it was not fitted to.

For each row of the reference set (benchmarks/published_runs.toml), `planner/validate.py`
predicts its MFU with efficiencies fitted on the other sources only, and `planner/fitted.py`
keeps measured / predicted for every row, by hardware generation. A prediction's interval is its
MFU (and tokens/s, and so its days and cost) times the 10th and 90th percentiles of those
ratios on comparable runs: the same generation when it has at least `MIN_COMPARABLE` rows, else
every row (and the band says when none is of the device's generation: Blackwell's today). A
mixture-of-experts model's band comes from the published MoE runs instead
(benchmarks/published_moe.toml, `MOE_RATIOS`: predicted by the fit on the dense rows, none of
them in it), which the dense rows' band would flatter. It says what the published record says of
this model's error, not a statistical confidence: the rows are few and not a random sample of
runs (few used cp).
On a CPU cluster there is no interval (`--calibrate` measures the planner there).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.fitted import HELD_OUT_RATIOS, MOE_RATIOS

MIN_COMPARABLE = 5
#: the generations of the published MoE runs' devices (a test holds it to the file)
MOE_GENERATIONS = ("hopper", "blackwell")
LOW_Q, HIGH_Q = 0.10, 0.90


@dataclass(frozen=True)
class Interval:
    """Multiplicative band around a prediction, and what it comes from."""

    low: float  # measured / predicted at the 10th percentile
    high: float  # ... at the 90th
    runs: int  # how many held-out published runs it is drawn from
    basis: str  # "hopper", "ampere", "all" or "moe"
    unseen: str = ""  # the device's generation where the published runs have none of it

    def around(self, value: float) -> tuple[float, float]:
        return value * self.low, value * self.high

    def drawn_from(self) -> str:
        """What the band's ratios are, in words."""
        none = f" (none on {self.unseen})" if self.unseen else ""
        if self.basis == "moe":
            return (f"{self.runs} published MoE runs{none} (benchmarks/published_moe.toml), "
                    "predicted by the fit on the dense runs, none of them in it")
        kind = "" if self.basis == "all" else self.basis + " "
        return f"{self.runs} published {kind}runs{none}, each predicted without its source"


def ratios(generation: str) -> tuple[tuple[float, ...], str]:
    """The held-out ratios comparable to a device of `generation`, and which set they are."""
    same = HELD_OUT_RATIOS.get(generation, ())
    if len(same) >= MIN_COMPARABLE:
        return same, generation
    every = tuple(r for rs in HELD_OUT_RATIOS.values() for r in rs)
    return every, "all"


def interval(generation: str, moe: bool = False) -> Interval | None:
    """The band for a device of `generation` ("" or a CPU: None), for an MoE model if `moe`."""
    if not generation:
        return None
    values, basis = (MOE_RATIOS, "moe") if moe else ratios(generation)
    if len(values) < 2:
        return None
    low, high = quantiles(values, (LOW_Q, HIGH_Q))
    seen = MOE_GENERATIONS if moe else tuple(g for g, rs in HELD_OUT_RATIOS.items() if rs)
    unseen = "" if generation in seen else generation
    return Interval(low=low, high=high, runs=len(values), basis=basis, unseen=unseen)


def quantiles(values: tuple[float, ...] | list[float], qs: tuple[float, ...]) -> list[float]:
    """Linear-interpolated quantiles (numpy's default), without numpy."""
    xs = sorted(values)
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        i = int(pos)
        j = min(i + 1, len(xs) - 1)
        out.append(xs[i] + (xs[j] - xs[i]) * (pos - i))
    return out


def describe(mfu: float, band: Interval | None) -> str:
    """"41.0 % MFU, 36-45 % on comparable published runs"."""
    if band is None:
        return f"{100 * mfu:.1f} % MFU"
    lo, hi = band.around(mfu)
    kind = {"all": "", "moe": "MoE "}.get(band.basis, band.basis + " ")
    none = f", none on {band.unseen}" if band.unseen else ""
    return (f"{100 * mfu:.1f} % MFU, {100 * lo:.0f}-{100 * hi:.0f} % on comparable published "
            f"runs ({band.runs} {kind}runs held out{none})")
