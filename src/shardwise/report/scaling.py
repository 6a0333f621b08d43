"""The page `shardwise scale` writes: the scaling table and curves (throughput against the ideal,
efficiency, communication share, time to the target, per world size), the runs' loss curves
overlaid, and the controlled comparison of the runs."""

from __future__ import annotations

import datetime as _dt
from html import escape
from pathlib import Path

from shardwise.compare.scaling import ScalePoint
from shardwise.compare.scorecard import Comparison
from shardwise.compare.text import fmt
from shardwise.meta import __version__
from shardwise.report.canvas import Plot, new_figure, to_png
from shardwise.telemetry.readback import Run


def scaling_plot(points: list[ScalePoint], mode: str, target: float | None) -> Plot:
    plot = Plot("scaling", "Scaling", f"{mode.capitalize()} scaling. Top left: tokens per second "
                "(median steady log window) against world size, with the ideal line from the "
                "smallest size; top right: scaling efficiency; bottom left: the share of step "
                "time spent in collectives; bottom right: training time to the target loss.")
    measured = [p for p in points if p.tokens_per_s]
    if not measured:
        plot.omitted = "no run recorded tokens_per_s"
        return plot
    fig, axes = new_figure(2, 3.0, cols=2)
    worlds = [p.world for p in points]
    w0, t0 = measured[0].world, measured[0].tokens_per_s or 0.0
    tput, eff, comm, ttt = axes
    tput.plot([p.world for p in measured], [p.tokens_per_s for p in measured], "o-",
              label="measured")
    tput.plot(worlds, [t0 * w / w0 for w in worlds], "--", color="grey", label="linear")
    tput.set(ylabel="tokens/s", title="throughput")
    tput.legend(fontsize=8)
    eff.plot([p.world for p in measured], [100 * (p.efficiency or 0) for p in measured], "o-",
             color="C2")
    eff.axhline(100, color="grey", ls="--")
    eff.set(ylabel="% of linear", title="scaling efficiency", ylim=(0, None))
    shares = [p for p in points if p.comm_share is not None]
    comm.bar([str(p.world) for p in shares], [100 * (p.comm_share or 0) for p in shares],
             color="C1")
    comm.set(ylabel="% of step time", title="communication share", xlabel="world size")
    hits = [p for p in points if p.time_to_target_s is not None]
    if hits:
        ttt.bar([str(p.world) for p in hits], [p.time_to_target_s or 0 for p in hits], color="C3")
        ttt.set(title=f"time to held-out loss {target:g}")
    else:
        ttt.text(0.5, 0.5, "no target loss" if target is None else f"no size reached {target:g}",
                 ha="center", va="center", transform=ttt.transAxes)
        ttt.set(title="time to target")
    ttt.set(ylabel="s", xlabel="world size")
    for ax in (tput, eff):
        ax.set_xscale("log", base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_xlabel("world size")
    for ax in axes:
        ax.grid(alpha=0.3)
    plot.png = to_png(fig)
    return plot


def write_scaling_page(points: list[ScalePoint], mode: str, target: float | None,
                       runs: list[Run], comparison: Comparison, out: Path) -> Path:
    from shardwise.report.canvas import safely
    from shardwise.report.curves import loss_plot, throughput_plot
    from shardwise.report.html import STYLE, plot_html
    from shardwise.report.scorecard import STYLE as CMP_STYLE
    from shardwise.report.scorecard import comparison_section

    head = ["world", "layout", "global batch", "tokens/s", "± (s.e.)", "per rank", "efficiency",
            "comm share", "step p50", "held-out loss", "time to target", "tokens to target",
            "launch"]
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(v)}</td>" for v in (
            str(p.world), p.layout, str(p.global_batch or "—"), fmt(p.tokens_per_s, "tokens/s"),
            fmt(p.tokens_per_s_se, "tokens/s"), fmt(p.tokens_per_s_per_rank, "tokens/s"),
            fmt(p.efficiency, "%"),
            fmt(p.comm_share, "%"), fmt(p.step_time_s, "s"), fmt(p.final_loss, "loss"),
            fmt(p.time_to_target_s, "s"), fmt(p.tokens_to_target, "tokens"),
            fmt(p.launch_s, "s"))) + "</tr>" for p in points)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>shardwise scaling: {escape(mode)}</title>",
             f"<style>{STYLE}{CMP_STYLE}</style></head><body>",
             f"<h1>shardwise scaling study ({escape(mode)})</h1>",
             f'<p class="meta">made by shardwise {escape(__version__)} on '
             f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; target loss "
             f"{escape(str(target) if target is not None else 'none')}</p>",
             '<table class="summary" id="scaling">'
             + "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr>" + rows
             + "</table>",
             plot_html(safely(lambda p: scaling_plot(p, mode, target), points)),
             plot_html(safely(loss_plot, runs)), plot_html(safely(throughput_plot, runs)),
             comparison_section(comparison), "</body></html>"]
    target_path = out / "index.html"
    target_path.write_text("\n".join(parts), encoding="utf-8")
    return target_path
