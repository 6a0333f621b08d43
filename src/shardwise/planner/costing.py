"""What a run will cost: for a token budget, the wall-clock days, device-hours, energy and money of
a predicted layout, each with the interval of the prediction it rests on.

    seconds      = tokens / predicted tokens/s
    device-hours = devices x seconds / 3600
    energy       = devices x seconds x (idle + (power - idle) x busy) x PUE
    money        = device-hours x the cluster's price per device-hour

`busy` is the share of the step the device computes (the compute terms of
`Prediction.breakdown`: GEMMs, attention, memory-bound work, the output layer, recompute, the
optimizer step); while it waits on the network or the pipeline it draws its idle power. Power,
idle power, PUE and price come from the cluster file ([device] power_w, idle_power_w; [cost]
pue, price_per_device_hour); a figure the cluster does not give is not shown. Days, hours, energy
and money scale with 1 / throughput, so the interval of the MFU (`planner/accuracy.py`) carries
over inverted: a run at the band's low MFU takes the band's high days. Failures, restarts,
checkpoints and evaluation are not in it (Llama 3's 405B run had >90 % effective training time,
"The Llama 3 Herd of Models" §3.3.4). Imports no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardwise.planner.accuracy import Interval
from shardwise.planner.cost import Prediction
from shardwise.spec.cluster import ClusterSpec

COMPUTE_TERMS = ("gemm", "attention", "memory_bound", "output_and_loss", "recompute", "optimizer")
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


@dataclass(frozen=True)
class RunCost:
    """One layout's run over a token budget; `*_range` from the prediction's interval."""

    tokens: float
    seconds: float
    device_hours: float
    energy_kwh: float | None  # None: the cluster gives no device power
    money: float | None  # None: the cluster gives no price
    busy: float  # share of the step the devices compute
    scale_range: tuple[float, float] | None  # (low, high) multipliers of every figure

    @property
    def days(self) -> float:
        return self.seconds / 86400.0


def parse_tokens(text: str) -> float:
    """A token budget: a number with an optional K, M, B/G or T suffix, in powers of ten
    ("15T" = 15 x 10^12 tokens)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMBGT]?)\s*", str(text), flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a token budget like 15T or 300B")
    return float(match.group(1)) * _SUFFIX[match.group(2).upper()]


def run_cost(pred: Prediction, cluster: ClusterSpec, tokens: float,
             band: Interval | None = None) -> RunCost:
    seconds = tokens / pred.tokens_per_s
    devices = cluster.world
    step = pred.step_time_s
    busy = min(1.0, sum(pred.breakdown.get(k, 0.0) for k in COMPUTE_TERMS) / step) if step else 1.0
    dev = cluster.device
    energy = None
    if dev.power_w > 0:
        watts = dev.idle_power_w + (dev.power_w - dev.idle_power_w) * busy
        energy = devices * seconds * watts * cluster.cost.pue / 3.6e6
    hours = devices * seconds / 3600.0
    price = cluster.cost.price_per_device_hour
    scale = (1.0 / band.high, 1.0 / band.low) if band else None
    return RunCost(tokens=tokens, seconds=seconds, device_hours=hours, energy_kwh=energy,
                   money=hours * price if price > 0 else None, busy=busy, scale_range=scale)


def _span(value: float, scale: tuple[float, float] | None, fmt: str) -> str:
    text = format(value, fmt)
    if scale is None:
        return text
    return f"{text} ({format(value * scale[0], fmt)}-{format(value * scale[1], fmt)})"


def cost_lines(preds: list[Prediction], cluster: ClusterSpec, tokens: float,
               band: Interval | None) -> list[str]:
    """A table of the run's cost for each of `preds`."""
    head = ["#", "layout", "days", "device-hours", "MWh", "cost", "busy %"]
    rows = [head]
    for i, p in enumerate(preds):
        c = run_cost(p, cluster, tokens, band)
        rows.append([str(i + 1), p.layout.name(), _span(c.days, c.scale_range, ".1f"),
                     _span(c.device_hours, c.scale_range, ",.0f"),
                     "-" if c.energy_kwh is None else _span(c.energy_kwh / 1000, c.scale_range,
                                                           ",.0f"),
                     "-" if c.money is None else _span(c.money, c.scale_range, ",.0f"),
                     f"{100 * c.busy:.0f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"a run of {tokens:,.0f} tokens on {cluster.world:,} devices "
             + ("(ranges: the prediction's interval)" if band else "") + ":"]
    lines += ["  " + "  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
              for r in rows]
    missing = [what for what, ok in (("[device] power_w", cluster.device.power_w > 0),
                                     ("[cost] price_per_device_hour",
                                      cluster.cost.price_per_device_hour > 0)) if not ok]
    if missing:
        lines.append("  (set " + " and ".join(missing) + " in a cluster file for the "
                     + ("energy" if "[device] power_w" in missing else "")
                     + (" and " if len(missing) == 2 else "")
                     + ("cost" if any("price" in m for m in missing) else "") + ")")
    lines.append("  energy = devices x time x (idle + (power - idle) x busy) x PUE; no failures, "
                 "restarts or checkpoints counted")
    return lines
