"""The plots over several runs, overlaid on one page (`shardwise report A B`, the scaling page):
loss against steps and tokens, throughput and MFU against time."""

from __future__ import annotations

import math
from collections.abc import Callable

from shardwise.report.canvas import (
    Plot,
    by_launch,
    integer_x,
    mark_relaunches,
    new_figure,
    series,
    to_png,
)
from shardwise.telemetry.readback import Run, finite, num


def loss_plot(runs: list[Run]) -> Plot:
    plot = Plot("loss", "Loss", "Train loss (solid) and held-out loss (dashed, dots) against "
                "optimizer steps and against tokens seen; dotted verticals mark where training "
                "went on from an earlier step (resume, restart, rollback).")
    if not any(series(r.steps(), "loss")[0] or series(r.evals(), "val_loss")[0] for r in runs):
        plot.omitted = "no step or eval event carries a finite loss"
        return plot
    fig, (by_step, by_tokens) = new_figure(2, 3.4)
    baseline_drawn = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        label = run.name if len(runs) > 1 else "train"
        steps, evals = run.steps(), run.evals()
        xs, ys = series(steps, "loss")
        by_step.plot(xs, ys, color=color, lw=1.5, label=label)
        vx, vy = series(evals, "val_loss")
        by_step.plot(vx, vy, color=color, ls="--", marker="o", ms=3,
                     label=f"{label} held-out" if len(runs) > 1 else "held-out")
        tokens_at = {int(e["step"]): t for e in steps if (t := num(e, "tokens_seen")) is not None}
        per_step = num(run.start, "tokens_per_step")
        tx, ty = series(steps, "loss", x="tokens_seen")
        by_tokens.plot(tx, ty, color=color, lw=1.5, label=label)
        ex = [tokens_at.get(int(s), s * per_step if per_step else math.nan) for s in vx]
        by_tokens.plot(ex, vy, color=color, ls="--", marker="o", ms=3,
                       label=f"{label} held-out" if len(runs) > 1 else "held-out")
        unigram = num(run.start, "unigram_loss")
        if finite(unigram) and not baseline_drawn:
            for ax in (by_step, by_tokens):
                ax.axhline(unigram, color="grey", lw=0.8, ls="-.", label="unigram baseline")
            baseline_drawn = True
        if len(runs) == 1:
            mark_relaunches(by_step, run)
    by_step.set(xlabel="step", ylabel="loss", title="loss vs step")
    integer_x(by_step)
    by_tokens.set(xlabel="tokens seen", ylabel="loss", title="loss vs tokens")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    plot.png = to_png(fig)
    return plot


def throughput_plot(runs: list[Run]) -> Plot:
    plot = Plot("throughput", "Throughput and MFU", "Global tokens per second and model FLOPs "
                "utilisation (MFU, and HFU when recomputation is on) against wall time since the "
                "run's first event.")
    have_tps = [r for r in runs if series(r.steps(), "tokens_per_s")[0]]
    if not have_tps:
        plot.omitted = "no step event carries tokens_per_s"
        return plot
    have_mfu = [r for r in runs if series(r.steps(), "mfu")[0] or series(r.steps(), "hfu")[0]]
    fig, axes = new_figure(2 if have_mfu else 1, 3.0)
    for i, run in enumerate(runs):
        steps = run.steps()
        axes[0].plot(*by_launch(run, steps, "tokens_per_s"), color=f"C{i}", marker=".",
                     label=run.name if len(runs) > 1 else "tokens/s")
        if have_mfu:
            for key, ls in (("mfu", "-"), ("hfu", "--")):
                t, v = by_launch(run, steps, key)
                if t:
                    axes[1].plot(t, [100 * y for y in v], color=f"C{i}", ls=ls,
                                 marker=".", label=f"{run.name} {key.upper()}" if len(runs) > 1
                                 else key.upper())
    axes[0].set(ylabel="tokens/s", title="throughput (global)")
    if have_mfu:
        axes[1].set(ylabel="% of peak", title="MFU / HFU")
        missing = [r.name for r in have_tps if r not in have_mfu]
        if missing:
            plot.caption += f" MFU: not recorded by {', '.join(missing)}."
    else:
        plot.caption += " MFU: not recorded by this run (no mfu field in its step events)."
    axes[-1].set_xlabel("seconds since the first event")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    plot.png = to_png(fig)
    return plot


COMPARE_PLOTS: tuple[Callable[[list[Run]], Plot], ...] = (loss_plot, throughput_plot)
