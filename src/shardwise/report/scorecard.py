"""A comparison in HTML: the verdict, the sides, the differences (infrastructure, seed, everything
else) and the scorecard, as a section of `shardwise report A B` and as the page `shardwise
compare` writes (with its plots). One file, PNGs embedded, no script, like every report."""

from __future__ import annotations

import datetime as _dt
from html import escape
from pathlib import Path

from shardwise.compare.fields import INFRASTRUCTURE, OTHER, SEED
from shardwise.compare.scorecard import Comparison
from shardwise.compare.text import cell, delta, value_text
from shardwise.meta import __version__

STYLE = """
.verdict { padding: 0.5em 0.9em; margin: 0.4em 0; border-left: 5px solid; }
.verdict.ok { background: #e8f5e9; border-color: #2e7d32; }
.verdict.no { background: #fdecea; border-color: #c62828; }
table.scorecard td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.blocks td { color: #b71c1c; font-weight: 600; }
"""


def comparison_section(c: Comparison, heading: str = "h2") -> str:
    """The verdict, sides, differences and scorecard of `c` as HTML."""
    parts = [f'<{heading} id="comparison">Controlled comparison</{heading}>']
    ok = c.controlled
    head = ("Controlled: only infrastructure differs." if ok else
            "Not controlled: the runs differ in more than infrastructure; no winner is called.")
    if len(c.sides) == 1:
        head = "One side: these runs differ only in their seed (the seed spread is below)."
    parts.append(f'<p class="verdict {"ok" if ok else "no"}" id="verdict-head">{escape(head)}</p>')
    for i, text in enumerate(c.verdicts, start=1):
        parts.append(f'<p class="verdict {"ok" if not c.pair_blocking(i) else "no"}">'
                     f"{escape(text)}</p>")
    parts.append(_sides(c))
    parts.append(_differences(c))
    parts.append(_scorecard(c))
    parts.append(f'<p class="meta">Noise: {escape(c.noise.source)}.</p>')
    parts.extend(f'<p class="note">{escape(n)}</p>' for n in c.notes)
    return "\n".join(parts)


def _sides(c: Comparison) -> str:
    rows = ["<tr><th>side</th><th>layout</th><th>runs</th><th>seeds</th></tr>"]
    for s in c.sides:
        rows.append(f"<tr><td>{escape(s.label)}</td><td>{escape(s.layout)}</td><td>"
                    + "<br>".join(escape(str(r.path)) for r in s.runs)
                    + f"</td><td>{escape(', '.join(map(str, s.seeds)))}</td></tr>")
    return '<table class="summary" id="sides">' + "".join(rows) + "</table>"


def _differences(c: Comparison) -> str:
    found = [("", d) for d in c.differences] + [(f"within {s}: ", d) for s, d in c.within]
    if not found:
        return '<p id="differences">No differences: the same job, run again.</p>'
    head = "".join(f"<th>{escape(s.label)}</th>" for s in c.sides)
    rows = [f"<tr><th>kind</th><th>field</th>{head}<th></th></tr>"]
    for kind in (INFRASTRUCTURE, SEED, OTHER):
        for prefix, d in ((p, d) for p, d in found if d.kind == kind):
            values = d.values if not prefix else [" | ".join(value_text(v) for v in d.values)] \
                + [""] * (len(c.sides) - 1)
            status = "allowed" if d.allowed and kind == OTHER else \
                "not infrastructure" if d.blocks else ""
            rows.append(f'<tr class="{"blocks" if d.blocks else ""}"><td>{escape(kind)}</td>'
                        f"<td><code>{escape(prefix + d.name)}</code></td>"
                        + "".join(f"<td>{escape(value_text(v))}</td>" for v in values)
                        + f"<td>{escape(status)}</td></tr>")
    return '<table class="summary" id="differences">' + "".join(rows) + "</table>"


def _scorecard(c: Comparison) -> str:
    n = len(c.sides)
    head = "".join(f"<th>{escape(s.label)}{' (baseline)' if i == 0 and n > 1 else ''}</th>"
                   for i, s in enumerate(c.sides))
    head += "".join(f"<th>{escape(s.label)} vs {escape(c.sides[0].label)}</th>"
                    for s in c.sides[1:])
    rows = [f"<tr><th>figure</th>{head}" + ("<th>verdict</th>" if n > 1 else "") + "</tr>"]
    for row in c.rows:
        verdicts = "; ".join(v for v in row.verdicts[1:] if v) if row.verdicts else ""
        rows.append(f'<tr id="row-{escape(row.key)}"><th>{escape(row.label)}</th>'
                    + "".join(f'<td class="num">{escape(cell(row, i))}</td>' for i in range(n))
                    + "".join(f'<td class="num">{escape(delta(row, i))}</td>'
                              for i in range(1, n))
                    + (f"<td>{escape(verdicts)}</td>" if n > 1 else "") + "</tr>")
    return '<table class="summary scorecard" id="scorecard">' + "".join(rows) + "</table>"


def write_comparison_page(c: Comparison, out: Path) -> Path:
    """`out/index.html`: the comparison and its plots."""
    from shardwise.report.canvas import safely
    from shardwise.report.compare_plots import COMPARISON_PLOTS
    from shardwise.report.html import STYLE as BASE_STYLE
    from shardwise.report.html import plot_html

    names = " vs ".join(f"{s.label} ({s.layout or s.runs[0].name})" for s in c.sides)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>shardwise comparison: {escape(names)}</title>",
             f"<style>{BASE_STYLE}{STYLE}</style></head><body>",
             f"<h1>shardwise comparison: {escape(names)}</h1>",
             f'<p class="meta">made by shardwise {escape(__version__)} on '
             f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}</p>",
             comparison_section(c)]
    parts += [plot_html(safely(make, c)) for make in COMPARISON_PLOTS]
    parts.append("</body></html>")
    target = out / "index.html"
    tmp = target.with_suffix(".html.tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(target)
    return target
