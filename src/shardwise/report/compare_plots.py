"""The pictures of a comparison, where a person would rather look than read a table: held-out
loss against tokens per side with its seed band and the target, time and tokens to the target,
the throughput of every log window, and every other figure relative to the baseline."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from matplotlib.ticker import FuncFormatter

from shardwise.compare.scorecard import Comparison
from shardwise.report.canvas import Plot, new_figure, to_png


def heldout_plot(c: Comparison) -> Plot:
    plot = Plot("cmp-heldout", "Held-out loss against tokens",
                "Each side in its own colour: every run as a thin line, the mean over its seeds "
                "as a thick one and the band between its lowest and highest run. Dashed: the "
                "target loss; dotted: the token count the scorecard compares at.")
    if not any(f.evals for s in c.sides for f in s.figures):
        plot.omitted = "no run has a held-out evaluation"
        return plot
    fig, (ax,) = new_figure(1, 3.6)
    for i, side in enumerate(c.sides):
        color = f"C{i}"
        curves = [{p.tokens: p.loss for p in f.evals if p.tokens is not None}
                  for f in side.figures]
        for curve in curves:
            xs = sorted(curve)
            ax.plot(xs, [curve[x] for x in xs], color=color, lw=0.8, alpha=0.5)
        common = sorted(set.intersection(*(set(cv) for cv in curves))) if curves else []
        if common:
            values = [[cv[x] for cv in curves] for x in common]
            ax.plot(common, [statistics.fmean(v) for v in values], color=color, lw=2.2,
                    marker="o", ms=3, label=f"{side.label}: {side.layout} ({len(curves)} run"
                                            f"{'s' if len(curves) > 1 else ''})")
            if len(curves) > 1:
                ax.fill_between(common, [min(v) for v in values], [max(v) for v in values],
                                color=color, alpha=0.15)
    if c.target_loss is not None:
        ax.axhline(c.target_loss, color="black", ls="--", lw=1, label=f"target {c.target_loss:g}")
    if c.equal_tokens is not None:
        ax.axvline(c.equal_tokens, color="grey", ls=":", lw=1)
    ax.set(xlabel="tokens trained", ylabel="held-out loss", title="held-out loss vs tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    plot.png = to_png(fig)
    return plot


def target_plot(c: Comparison) -> Plot:
    plot = Plot("cmp-target", "Time and tokens to the target",
                "Bars: the mean over a side's runs; dots: each run. A side that did not reach "
                "the target has no bar.")
    if c.target_loss is None:
        plot.omitted = "no target loss (eval.target_loss, or --target-loss)"
        return plot
    hits = [[f.target for f in s.figures] for s in c.sides]
    if not any(h for side in hits for h in side):
        plot.omitted = f"no run reached held-out loss {c.target_loss:g}"
        return plot
    fig, axes = new_figure(1, 3.0, cols=2)
    labels = [s.label for s in c.sides]
    for ax, what, unit in ((axes[0], "seconds", "s"), (axes[1], "tokens", "tokens")):
        for i, side in enumerate(hits):
            values = [getattr(h, what) for h in side if h is not None and getattr(h, what)
                      is not None]
            if values:
                ax.bar(i, statistics.fmean(values), color=f"C{i}", alpha=0.7)
                ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(labels)), labels)
        ax.set(ylabel=unit, title=f"{what} to held-out loss {c.target_loss:g}")
        ax.grid(alpha=0.3, axis="y")
    plot.png = to_png(fig)
    return plot


def speed_plot(c: Comparison) -> Plot:
    plot = Plot("cmp-speed", "Throughput and step time",
                "Left: tokens per second of every steady log window (the first window of a "
                "launch, its warm-up, left out), all runs of a side together. Right: the median "
                "and the p99 step time per side.")
    windows = [[v for f in s.figures for v in f.tokens_per_s] for s in c.sides]
    if not any(windows):
        plot.omitted = "no step event carries tokens_per_s"
        return plot
    fig, (left, right) = new_figure(1, 3.0, cols=2)
    labels = [s.label for s in c.sides]
    shown = [w if w else [math.nan] for w in windows]
    left.boxplot(shown, tick_labels=labels)
    left.set(ylabel="tokens/s", title="throughput per log window")
    p50 = [statistics.fmean(v) if (v := [statistics.median(f.step_time_s) for f in s.figures
                                         if f.step_time_s]) else math.nan for s in c.sides]
    p99 = [statistics.fmean(v) if (v := [max(f.step_p99_s) for f in s.figures if f.step_p99_s])
           else math.nan for s in c.sides]
    xs = range(len(labels))
    right.bar([x - 0.2 for x in xs], [1000 * v for v in p50], width=0.4, label="p50")
    right.bar([x + 0.2 for x in xs], [1000 * v for v in p99], width=0.4, label="p99 (worst)")
    right.set_xticks(list(xs), labels)
    right.set(ylabel="ms", title="step time")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3, axis="y")
    plot.png = to_png(fig)
    return plot


def relative_plot(c: Comparison) -> Plot:
    plot = Plot("cmp-relative", "Every figure relative to the baseline",
                "Each side's mean divided by the baseline's, per figure of the scorecard; green "
                "where the change is in the direction a reader wants (lower memory, higher "
                "throughput), red where it is not. Only figures both sides recorded.")
    if len(c.sides) < 2:
        plot.omitted = "one side only: nothing to compare against"
        return plot
    rows = [r for r in c.rows if r.stats[0] is not None and r.stats[0].mean
            and any(s is not None for s in r.stats[1:])]
    if not rows:
        plot.omitted = "no figure recorded by the baseline and another side"
        return plot
    fig, (ax,) = new_figure(1, max(2.5, 0.32 * len(rows) * (len(c.sides) - 1) + 1))
    y = 0
    ticks, names = [], []
    for row in reversed(rows):
        for i in range(1, len(c.sides)):
            s = row.stats[i]
            base = row.stats[0]
            if s is None or base is None:
                continue
            ratio = s.mean / base.mean
            if ratio <= 0:  # no bar on a log axis; the table has the numbers
                continue
            good = (ratio < 1) == (row.better == "lower") if row.better and ratio != 1 else None
            color = "grey" if good is None else "tab:green" if good else "tab:red"
            ax.barh(y, ratio - 1, left=1, color=color)
            ticks.append(y)
            names.append(f"{row.label} ({c.sides[i].label})")
            y += 1
    ax.axvline(1, color="black", lw=0.8)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set(xlabel=f"× baseline ({c.sides[0].label})", title="relative to the baseline")
    ax.grid(alpha=0.3, axis="x")
    plot.png = to_png(fig)
    return plot


COMPARISON_PLOTS: tuple[Callable[[Comparison], Plot], ...] = (
    heldout_plot, target_plot, speed_plot, relative_plot)
