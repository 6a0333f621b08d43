"""A comparison as the terminal shows it: the sides, the differences split into infrastructure
and everything else, the scorecard side by side, and one verdict line per side."""

from __future__ import annotations

import json
from typing import Any

from shardwise.compare.fields import INFRASTRUCTURE, OTHER, SEED, Difference
from shardwise.compare.rows import Row
from shardwise.compare.scorecard import Comparison
from shardwise.compare.stats import Stat

MISSING = "—"


def fmt(value: float | None, unit: str) -> str:
    """One number in its unit, at a precision a reader can compare."""
    if value is None:
        return MISSING
    if unit == "loss":
        return f"{value:.4f}"
    if unit in ("tokens", "count"):
        return f"{value:,.0f}"
    if unit == "tokens/s":
        return f"{value:,.0f}"
    if unit == "%":
        return f"{100 * value:.1f} %"
    if unit == "ratio":
        return f"{value:.2f}×"
    if unit in ("bytes", "bytes/s"):
        return _bytes(value) + ("/s" if unit == "bytes/s" else "")
    if unit == "s":
        return f"{1000 * value:.1f} ms" if abs(value) < 1 else f"{value:,.1f} s"
    if unit == "h":
        return f"{value:.4f} h" if value < 10 else f"{value:,.1f} h"
    if unit == "J":
        return f"{value / 1000:,.2f} kJ" if abs(value) >= 1000 else f"{value:,.1f} J"
    if unit == "J/token":
        return f"{1000 * value:.3f} mJ/token"
    if unit == "money":
        return f"{value:,.4f}" if value < 100 else f"{value:,.2f}"
    return f"{value:g}"


def _bytes(value: float) -> str:
    for scale, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {name}"
    return f"{value:.0f} B"


def cell(row: Row, i: int) -> str:
    """A side's value: the mean, ± the seed spread when the side has several runs."""
    if row.texts and row.texts[i]:
        return row.texts[i] or MISSING
    s: Stat | None = row.stats[i]
    if s is None:
        return MISSING
    text = fmt(s.mean, row.unit)
    if s.sd is not None:
        text += f" ± {fmt(s.sd, row.unit).replace(' %', ' pp')} (n={s.n})"
    return text


def delta(row: Row, i: int) -> str:
    d, rel = row.delta(i), row.relative(i)
    if d is None:
        return ""
    if row.unit == "loss":
        return f"{d:+.1e}" if 0 < abs(d) < 5e-5 else f"{d:+.4f}"
    return f"{rel:+.1%}" if rel is not None else f"{d:+g}"


def value_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def render(c: Comparison) -> str:
    lines = [_heading(c), ""]
    for side in c.sides:
        seeds = ", ".join(map(str, side.seeds))
        lines.append(f"  {side.label}  {side.layout:<22} {len(side.runs)} run"
                     f"{'s' if len(side.runs) > 1 else ''} (seed {seeds}): "
                     + ", ".join(str(r.path) for r in side.runs))
    lines += ["", *_differences(c), "", *_scorecard(c), ""]
    lines += [f"noise: {c.noise.source}"]
    lines += [f"note: {n}" for n in c.notes]
    lines += ["", *[f"verdict: {v}" for v in c.verdicts]]
    return "\n".join(lines)


def _heading(c: Comparison) -> str:
    if len(c.sides) == 1:
        return (f"compare: one side ({len(c.sides[0].runs)} runs that differ only in their seed):"
                " the seed spread below, nothing to compare against")
    if c.controlled:
        allowed = [d.name for d in c.differences if d.allowed and d.kind == OTHER]
        return ("compare: CONTROLLED — only infrastructure differs"
                + (f" (and, allowed: {', '.join(allowed)})" if allowed else ""))
    return ("compare: NOT CONTROLLED — the runs differ in more than infrastructure; the figures "
            "are shown, no winner is called")


def _differences(c: Comparison) -> list[str]:
    rows: list[tuple[str, Difference, str]] = [("", d, "") for d in c.differences]
    rows += [(f"within {label}: ", d, "") for label, d in c.within]
    if not rows:
        return ["differences: none (the same job, run again)"]
    width = max(len(prefix + d.name) for prefix, d, _ in rows)
    out = ["differences (values: " + " | ".join(s.label for s in c.sides) + "; within a side: "
           "one per run)"]
    for heading, kinds in (("infrastructure", (INFRASTRUCTURE,)), ("seed", (SEED,)),
                           ("everything else", (OTHER,))):
        chosen = [(p, d) for p, d, _ in rows if d.kind in kinds]
        out.append(f"  {heading}: " + ("none" if not chosen else ""))
        for prefix, d in chosen:
            mark = " (allowed)" if d.allowed and d.kind == OTHER else \
                "  <- not infrastructure" if d.blocks else ""
            out.append(f"    {prefix + d.name:<{width}}  "
                       + " | ".join(value_text(v) for v in d.values) + mark)
    return out


def _scorecard(c: Comparison) -> list[str]:
    labels = [f"{s.label}{' (baseline)' if i == 0 and len(c.sides) > 1 else ''}"
              for i, s in enumerate(c.sides)]
    table = [["scorecard", *labels, *[f"{s.label} vs {c.sides[0].label}" for s in c.sides[1:]],
              *(["verdict"] if len(c.sides) > 1 else [])]]
    for row in c.rows:
        verdicts = [row.verdicts[i] for i in range(1, len(c.sides))] if row.verdicts else []
        table.append([row.label, *[cell(row, i) for i in range(len(c.sides))],
                      *[delta(row, i) for i in range(1, len(c.sides))],
                      *(["; ".join(v for v in verdicts if v)] if len(c.sides) > 1 else [])])
    widths = [max(len(r[j]) for r in table) for j in range(len(table[0]) - 1)]
    lines = []
    for r in table:
        lines.append("  ".join(f"{v:<{w}}" if j == 0 else f"{v:>{w}}"
                               for j, (v, w) in enumerate(zip(r, widths, strict=False)))
                     + (f"  {r[-1]}" if len(r) > len(widths) else ""))
    return lines


def as_dict(c: Comparison) -> dict[str, Any]:
    """Everything the comparison found, for machines (`--json`, comparison.json)."""
    def diff(d: Difference) -> dict[str, Any]:
        return {"name": d.name, "kind": d.kind, "values": d.values, "allowed": d.allowed,
                "blocks": d.blocks}

    def side_stat(row: Row, i: int) -> dict[str, Any] | None:
        s = row.stats[i]
        text = row.texts[i] if row.texts else None
        if s is None:
            return {"text": text} if text else None
        return {"mean": s.mean, "sd": s.sd, "n": s.n, "values": list(s.values), "text": text}

    return {
        "controlled": c.controlled,
        "sides": [{"label": s.label, "runs": [str(r.path) for r in s.runs], "seeds": s.seeds,
                   "layout": s.layout} for s in c.sides],
        "differences": [diff(d) for d in c.differences],
        "within": [{"side": label, **diff(d)} for label, d in c.within],
        "noise": {"sigma": c.noise.sigma, "source": c.noise.source},
        "equal_tokens": c.equal_tokens, "target_loss": c.target_loss, "price": c.price,
        "scorecard": [{"key": r.key, "label": r.label, "unit": r.unit, "better": r.better,
                       "sides": [side_stat(r, i) for i in range(len(c.sides))],
                       "verdicts": r.verdicts} for r in c.rows],
        "verdicts": c.verdicts,
        "notes": c.notes,
    }
