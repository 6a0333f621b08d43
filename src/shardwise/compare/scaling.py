"""A scaling study read back from its runs: per world size, throughput, scaling efficiency,
communication share and time to the target loss.

Efficiency is throughput relative to linear scaling from the smallest world size:
E(w) = T(w) / (T(w0) * w / w0), T the steady tokens per second (median log window). Under strong
scaling (fixed global batch) that is the speed-up per added worker; under weak scaling (fixed
batch per rank) it is how well the per-rank throughput holds up. Both are the same formula
because the work per token does not change with the world size.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from shardwise.compare.figures import figures_of
from shardwise.compare.runs import RunData
from shardwise.compare.stats import median_se
from shardwise.compare.text import fmt

STRONG, WEAK = "strong", "weak"


@dataclass(frozen=True)
class ScalePoint:
    world: int
    run_dir: str
    layout: str
    global_batch: int | None
    tokens_per_s: float | None
    tokens_per_s_se: float | None  # standard error of that median, from its log windows
    tokens_per_s_per_rank: float | None
    efficiency: float | None
    comm_share: float | None
    step_time_s: float | None
    final_loss: float | None  # held-out, at the last evaluation
    tokens: int | None
    time_to_target_s: float | None
    tokens_to_target: float | None
    launch_s: float | None  # wall time of the whole launch, start-up included (when measured)


def scale_points(runs: list[tuple[int, RunData, float | None]], target: float | None
                 ) -> list[ScalePoint]:
    """`runs`: (world size, run, wall seconds of its launch or None), smallest world first."""
    points: list[ScalePoint] = []
    base: tuple[int, float] | None = None
    for world, data, launch_s in sorted(runs, key=lambda r: r[0]):
        f = figures_of(data, target)
        tps = statistics.median(f.tokens_per_s) if f.tokens_per_s else None
        if base is None and tps:
            base = (world, tps)
        eff = tps / (base[1] * world / base[0]) if tps and base else None
        batch = data.facts.get("batch.global_batch")
        points.append(ScalePoint(
            world=world, run_dir=str(data.path), layout=str(data.facts.get("topology.layout", "")),
            global_batch=int(batch) if isinstance(batch, int) else None, tokens_per_s=tps,
            tokens_per_s_se=median_se(f.tokens_per_s),
            tokens_per_s_per_rank=tps / world if tps else None, efficiency=eff,
            comm_share=f.comm_share,
            step_time_s=statistics.median(f.step_time_s) if f.step_time_s else None,
            final_loss=f.evals[-1].loss if f.evals else None, tokens=f.tokens,
            time_to_target_s=f.target.seconds if f.target else None,
            tokens_to_target=f.target.tokens if f.target else None, launch_s=launch_s))
    return points


def render(points: list[ScalePoint], mode: str, target: float | None) -> str:
    head = ["world", "layout", "global batch", "tokens/s", "±", "per rank", "efficiency",
            "comm share", "step p50", "held-out", f"to {target:g} (s)" if target else "to target",
            "tokens to target", "launch (s)"]
    rows = [head]
    for p in points:
        rows.append([str(p.world), p.layout, str(p.global_batch or "—"),
                     fmt(p.tokens_per_s, "tokens/s"), _spread(p),
                     fmt(p.tokens_per_s_per_rank, "tokens/s"),
                     fmt(p.efficiency, "%"), fmt(p.comm_share, "%"), fmt(p.step_time_s, "s"),
                     fmt(p.final_loss, "loss"),
                     ("not reached" if p.time_to_target_s is None else fmt(p.time_to_target_s, "s"))
                     if target else "no target",
                     fmt(p.tokens_to_target, "tokens") if target else "—",
                     fmt(p.launch_s, "s")])
    widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
    lines = [f"{mode} scaling ({'fixed global batch' if mode == STRONG else 'fixed batch per rank'})"
             f"; efficiency against linear scaling from world {points[0].world}"]
    lines += ["  ".join(v.rjust(w) if j else v.ljust(w) for j, (v, w) in
                        enumerate(zip(r, widths, strict=True))) for r in rows]
    noisy = [p.world for p in points if _relative_se(p) > NOISY]
    if noisy:
        lines.append(f"note: the throughput of world {', '.join(map(str, noisy))} varied by more "
                     f"than {NOISY:.0%} (standard error of the median, ± above) between log "
                     "windows: was something else running on the machine? Its efficiency is "
                     "uncertain by as much.")
    return "\n".join(lines)


#: a relative standard error of throughput above this is worth a note
NOISY = 0.05


def _relative_se(p: ScalePoint) -> float:
    if not p.tokens_per_s or p.tokens_per_s_se is None:
        return 0.0
    return p.tokens_per_s_se / p.tokens_per_s


def _spread(p: ScalePoint) -> str:
    return f"{_relative_se(p):.1%}" if p.tokens_per_s_se is not None else "—"


def as_dict(points: list[ScalePoint], mode: str, target: float | None) -> dict[str, Any]:
    return {"mode": mode, "target_loss": target, "points": [asdict(p) for p in points]}
