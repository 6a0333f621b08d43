"""The report page: one HTML file with its PNGs embedded as data URIs, so it can be mailed, copied
off a cluster or opened with no network and no server; no script, no external stylesheet."""

from __future__ import annotations

import base64
import datetime as _dt
from html import escape

from shardwise.meta import __version__
from shardwise.report.canvas import Plot
from shardwise.telemetry.readback import Run

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1040px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
.meta, .caption, .omitted { color: #555; font-size: 0.9em; }
.note { background: #fff4d6; border-left: 4px solid #e0a800; padding: 0.4em 0.8em; margin: 0.3em 0; }
table.summary { border-collapse: collapse; margin: 0.8em 0; }
table.summary th, table.summary td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: left; }
table.summary th { background: #f3f3f3; font-weight: 600; }
figure { margin: 0.6em 0 1.2em 0; } img { max-width: 100%; height: auto; border: 1px solid #eee; }
"""


def render(runs: list[Run], rows: list[tuple[str, list[str]]], compare: list[Plot],
           per_run: list[tuple[Run, list[Plot]]], sections: tuple[str, ...] = (),
           style: str = "") -> str:
    """`sections`: HTML placed after the summary table (the controlled comparison of several
    runs); `style`: CSS they need."""
    names = ", ".join(r.name for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>shardwise report: {escape(names)}</title>",
        f"<style>{STYLE}{style}</style></head><body>",
        f"<h1>shardwise report: {escape(names)}</h1>",
        f'<p class="meta">made by shardwise {escape(__version__)} on '
        f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')} from "
        + ", ".join(f"<code>{escape(str(r.run_dir / 'metrics.jsonl'))}</code>" for r in runs)
        + "</p>",
    ]
    for run in runs:
        for note in run.notes:
            prefix = f"{run.name}: " if len(runs) > 1 else ""
            parts.append(f'<p class="note">{escape(prefix + note)}</p>')
    parts.append(_table(rows))
    parts.extend(sections)
    parts.append("<h2>Comparison</h2>" if len(runs) > 1 else "")
    parts.extend(plot_html(p) for p in compare)
    for run, plots in per_run:
        if len(runs) > 1:
            parts.append(f'<h2 id="run-{escape(run.name)}">Run {escape(run.name)}</h2>')
        parts.extend(plot_html(p, prefix=f"{run.name}-" if len(runs) > 1 else "") for p in plots)
    parts.append("</body></html>")
    return "\n".join(p for p in parts if p)


def _table(rows: list[tuple[str, list[str]]]) -> str:
    out = ['<table class="summary" id="summary">']
    for label, cells in rows:
        tag = "th" if label == "run" else "td"
        out.append(f"<tr><th>{escape(label)}</th>"
                   + "".join(f"<{tag}>{escape(c)}</{tag}>" for c in cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def plot_html(plot: Plot, prefix: str = "") -> str:
    anchor = f"plot-{prefix}{plot.id}"
    head = f"<h2>{escape(plot.title)}</h2>" if not prefix else f"<h3>{escape(plot.title)}</h3>"
    if plot.png is None:
        return (f'{head}\n<p class="omitted" id="{escape(anchor)}">Plot omitted: '
                f"{escape(plot.omitted)}.</p>")
    width, height = plot.size
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'{head}\n<figure><img id="{escape(anchor)}" alt="{escape(plot.title)}" width="{width}" '
            f'height="{height}" src="data:image/png;base64,{data}">'
            f'<figcaption class="caption">{escape(plot.caption)}</figcaption></figure>')
