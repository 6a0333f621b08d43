"""One PNG per question a reader asks of one run: which rank is slow, where do the bytes go, how
much memory, how the pipeline and the optimizer behave, what went wrong when (`RUN_PLOTS`, in the
page's order). The curves over several runs (loss, throughput) are `report/curves.py`.

Each function returns a `Plot` (`report/canvas.py`): PNG bytes, or the reason it was left out (the
run did not record that data) so the page can say so instead of failing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from matplotlib.colors import TwoSlopeNorm

from shardwise.report.canvas import (
    Plot,
    bytes_unit,
    finish_step_panels,
    integer_x,
    new_figure,
    series,
    to_png,
)
from shardwise.telemetry.readback import FAULT_KINDS, Run, finite, num, num_list

# --- plots of one run --------------------------------------------------------------------------------

def step_time_plot(run: Run) -> Plot:
    plot = Plot("step-time", "Step time per rank", "")
    steps = run.steps()
    key = "compute_s_per_rank" if any(num_list(e, "compute_s_per_rank") for e in steps) \
        else "step_time_s_per_rank"
    rows = [(int(e["step"]), vals) for e in steps if (vals := num_list(e, key))]
    if not rows:
        plot.omitted = "no step event carries step_time_s_per_rank"
        return plot
    width = max(len(v) for _, v in rows)
    grid = [[v[r] if r < len(v) else math.nan for r in range(width)] for _, v in rows]
    rel = []
    for window in grid:
        ok = [v for v in window if finite(v)]
        med = statistics.median(ok) if ok else math.nan
        rel.append([v / med if finite(v) and med > 0 else math.nan for v in window])
    flat = [v for w in rel for v in w if finite(v)] or [1.0]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(flat), 0.9), vmax=max(max(flat), 1.1))
    pct_keys = [k for k in ("step_time_p50_s_per_rank", "step_time_p90_s_per_rank",
                            "step_time_p99_s_per_rank") if num_list(steps[-1], k)]
    fig, axes = new_figure(2 if pct_keys else 1, 3.2)
    ax = axes[0]
    # ranks on the y axis, log windows on the x axis: a straggler is a red row
    image = ax.imshow([list(col) for col in zip(*rel, strict=True)], aspect="auto", origin="lower",
                      cmap="coolwarm", norm=norm, interpolation="nearest")
    fig.colorbar(image, ax=ax, label="× median of the window")
    ticks = list(range(len(rows)))[:: max(1, len(rows) // 12)]
    ax.set_xticks(ticks, [str(rows[i][0]) for i in ticks])
    ax.set(xlabel="log window (step)", ylabel="rank")
    if width <= 16:
        ax.set_yticks(range(width))
    for event in run.of("straggler"):
        rank, step = num(event, "straggler_rank"), num(event, "step")
        if rank is None or step is None:
            continue
        col = min(range(len(rows)), key=lambda i: abs(rows[i][0] - step))
        ax.add_patch(_box(col, int(rank)))
    what = ("compute time (step time minus time waiting in collectives)" if key.startswith("compute")
            else "step time")
    ax.set_title(f"{what} per rank, relative to the window median")
    plot.caption = (f"Each cell is one rank's {what} in one log window divided by the median over "
                    "ranks in that window: a slow rank shows as a red row. Boxes mark straggler "
                    "events.")
    if pct_keys:
        for k, style in zip(pct_keys, ("-o", "-s", "-^"), strict=False):
            vals = num_list(steps[-1], k) or []
            axes[1].plot(range(len(vals)), [1000 * v for v in vals], style, ms=3,
                         label=k.split("_")[2])
        axes[1].set(xlabel="rank", ylabel="ms",
                    title=f"step-time percentiles per rank (window ending at step {steps[-1]['step']})")
        axes[1].grid(alpha=0.3)
        axes[1].legend(fontsize=8)
        integer_x(axes[1])
    plot.png = to_png(fig)
    return plot


def _box(col: int, row: int) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="black", lw=2)


def comm_plot(run: Run) -> Plot:
    plot = Plot("comm", "Communication", "Bytes and time per step of every collective, "
                "by operation and mesh axis (mean over the logged windows, per rank).")
    steps = run.steps()
    totals: dict[str, list[float]] = {}
    n = 0
    for e in steps:
        by_op = e.get("comm_by_op")
        if not isinstance(by_op, dict) or not by_op:
            continue
        n += 1
        for name, rec in by_op.items():
            if isinstance(rec, dict):
                acc = totals.setdefault(str(name), [0.0, 0.0, 0.0])
                for i, field in enumerate(("bytes", "time_s", "calls")):
                    acc[i] += v if finite(v := num(rec, field)) else 0.0
    tx, tb = series(steps, "comm_bytes")
    if not totals and not tx:
        plot.omitted = "no step event carries comm_by_op or comm_bytes (communication counting off?)"
        return plot
    rows = (1 if totals else 0) + (1 if tx else 0)
    fig, axes = new_figure(rows, 3.2, cols=2 if totals else 1)
    if totals:
        names = sorted(totals, key=lambda k: totals[k][0])
        axis_of = [k.split(":", 1)[1] if ":" in k else "?" for k in names]
        colors = {a: f"C{i}" for i, a in enumerate(sorted(set(axis_of)))}
        byte_vals = [totals[k][0] / n for k in names]
        scale, unit = bytes_unit(byte_vals)
        bars = [colors[a] for a in axis_of]
        axes[0].barh(names, [v / scale for v in byte_vals], color=bars)
        axes[0].set(xlabel=f"{unit} per step", title="bytes by op:axis")
        axes[1].barh(names, [1000 * totals[k][1] / n for k in names], color=bars)
        axes[1].set(xlabel="ms per step", title="time by op:axis")
        axes[1].set_yticks(range(len(names)), [""] * len(names))
    if tx:
        ax = axes[-2] if totals else axes[0]
        scale, unit = bytes_unit(tb)
        ax.plot(tx, [v / scale for v in tb], marker=".", color="C0")
        ax.set(xlabel="step", ylabel=f"{unit} per step", title="bytes sent per rank per step")
        ratio = [v for e in steps if finite(v := num(e, "comm_ratio_to_min"))]
        if ratio:
            ax.set_title(f"bytes sent per rank per step ({ratio[-1]:.2f}× the layout's minimum)")
        ct, cv = series(steps, "comm_time_s")
        if totals:
            ax2 = axes[-1]
            ax2.plot(ct, [1000 * v for v in cv], marker=".", color="C1")
            ax2.set(xlabel="step", ylabel="ms per step", title="time in collectives")
        elif ct:
            twin = ax.twinx()
            twin.plot(ct, [1000 * v for v in cv], marker=".", color="C1")
            twin.set_ylabel("ms in collectives", color="C1")
    for ax in axes:
        ax.grid(alpha=0.3)
    if tx:
        integer_x(*axes[-2 if totals else -1:])
    plot.png = to_png(fig)
    return plot


def memory_plot(run: Run) -> Plot:
    plot = Plot("memory", "Memory per rank", "Peak memory per rank over the run (CUDA allocated "
                "on GPU, process RSS on CPU), and the bytes of model state each rank holds.")
    peak: list[float] = []
    for e in run.steps():
        vals = num_list(e, "peak_mem_bytes_per_rank")
        if vals:  # the maximum per rank over the run (the world may change on resume)
            n = max(len(peak), len(vals))
            pad = [*peak, *[math.nan] * (n - len(peak))], [*vals, *[math.nan] * (n - len(vals))]
            peak = [max(a, b) if finite(a) and finite(b) else (a if finite(a) else b)
                    for a, b in zip(*pad, strict=True)]
    states = run.of("memory") or run.of("model_state")  # "memory" adds activations
    state = states[-1] if states else {}
    parts = {k.removesuffix("_bytes_per_rank"): v for k in state
             if k.endswith("_bytes_per_rank") and (v := num_list(state, k))}
    if not peak:
        scalar = [x for e in run.steps() if finite(x := num(e, "peak_mem_bytes"))]
        if scalar:
            peak = [max(scalar)]
    if not peak and not parts:
        plot.omitted = "no peak_mem_bytes in step events and no model_state event"
        return plot
    fig, axes = new_figure((1 if peak else 0) + (1 if parts else 0), 3.0)
    ax_iter = iter(axes)
    if peak:
        ax = next(ax_iter)
        scale, unit = bytes_unit(peak)
        ax.bar(range(len(peak)), [v / scale for v in peak], color="C0")
        ax.set(xlabel="rank", ylabel=unit, title="peak memory per rank")
    if parts:
        ax = next(ax_iter)
        scale, unit = bytes_unit([v for vals in parts.values() for v in vals])
        width = 0.8 / len(parts)
        for i, (name, vals) in enumerate(parts.items()):
            ax.bar([r + (i - (len(parts) - 1) / 2) * width for r in range(len(vals))],
                   [v / scale for v in vals], width=width, label=name.replace("_", " "))
        ax.set(xlabel="rank", ylabel=unit, title="model state per rank")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
        integer_x(ax)
    plot.png = to_png(fig)
    return plot


def bubble_plot(run: Run) -> Plot:
    plot = Plot("bubble", "Pipeline bubble", "Fraction of each step the pipeline stages "
                "sat idle, per logged step.")
    xs, ys = series(run.steps(), "bubble_fraction")
    if not xs:
        plot.omitted = "no bubble_fraction in step events: this run has no pipeline stages"
        return plot
    fig, (ax,) = new_figure(1, 2.8)
    ax.plot(xs, [100 * y for y in ys], marker=".", color="C2", label="measured")
    theory = [v for e in run.steps() if finite(v := num(e, "bubble_fraction_theory"))]
    if theory:
        ax.axhline(100 * theory[-1], color="grey", ls="--", label="schedule's theory")
    ax.legend(fontsize=8)
    ax.set(xlabel="step", ylabel="% of step idle", title="pipeline bubble", ylim=(0, None))
    integer_x(ax)
    ax.grid(alpha=0.3)
    plot.png = to_png(fig)
    return plot


def optimizer_plot(run: Run) -> Plot:
    plot = Plot("optimizer", "Optimizer", "Learning rate, gradient norm (before clipping) and, "
                "with fp16, the loss scale.")
    steps = run.steps()
    panels = [(k, series(steps, k)) for k in ("lr", "grad_norm", "loss_scale")]
    panels = [(k, s) for k, s in panels if s[0]]
    if not panels:
        plot.omitted = "no lr, grad_norm or loss_scale in step events"
        return plot
    fig, axes = new_figure(len(panels), 2.2, sharex=True)
    for ax, (key, (xs, ys)) in zip(axes, panels, strict=True):
        ax.plot(xs, ys, marker=".", color="C3" if key == "grad_norm" else "C0")
        ax.set(ylabel=key.replace("_", " "))
        if key == "loss_scale":
            ax.set_yscale("log", base=2)
    return finish_step_panels(plot, fig, axes, run)


def experts_plot(run: Run) -> Plot:
    """Routing of a mixture-of-experts run, from the step events' `moe_*` fields
    (`shardwise.telemetry.experts`)."""
    plot = Plot("experts", "Experts", "Assignments per expert per layer (min-max band and mean), "
                "load imbalance (coefficient of variation, 0 = balanced) and the Switch balance "
                "loss (1.0 = balanced); dropped assignments and the selection bias's drift when "
                "the run has them.")
    steps = run.steps()
    band = [(e["step"], num(e, "moe_load_min"), num(e, "moe_load_mean"), num(e, "moe_load_max"))
            for e in steps]
    band = [b for b in band if all(finite(v) for v in b[1:])]
    if not band:
        plot.omitted = "no moe_load_* fields in step events (not a mixture-of-experts run)"
        return plot
    extra = [k for k in ("moe_dropped_fraction", "moe_bias_abs_max")
             if any(v for v in series(steps, k)[1])]
    fig, axes = new_figure(3 + len(extra), 2.0, sharex=True)
    xs = [b[0] for b in band]
    axes[0].fill_between(xs, [b[1] for b in band], [b[3] for b in band], alpha=0.3,
                         label="min-max over experts and layers")
    axes[0].plot(xs, [b[2] for b in band], marker=".", label="mean")
    axes[0].set(ylabel="assignments")
    axes[0].legend(loc="best", fontsize="small")
    for ax, key, label in zip(axes[1:], ("moe_load_cv", "moe_aux_loss", *extra),
                              ("load CV", "balance loss", *(k.removeprefix("moe_").replace(
                                  "_", " ") for k in extra)), strict=True):
        ax.plot(*series(steps, key), marker=".")
        ax.set(ylabel=label)
    return finish_step_panels(plot, fig, axes, run)


def checkpoint_plot(run: Run) -> Plot:
    plot = Plot("checkpoint", "Checkpoints", "Seconds each checkpoint save took: time training "
                "was stalled and time spent writing (when recorded), else the whole save.")
    ckpts = run.of("checkpoint")
    if not ckpts:
        plot.omitted = "no checkpoint event (checkpointing was off or no save was reached)"
        return plot
    fig, (ax,) = new_figure(1, 2.6)
    labels = [str(e.get("step")) for e in ckpts]
    x = range(len(ckpts))
    stall = [num(e, "stall_s") for e in ckpts]
    write = [num(e, "write_s") for e in ckpts]
    split = [a is not None or b is not None for a, b in zip(stall, write, strict=True)]
    s = [v or 0.0 for v in stall]
    if any(split):
        ax.bar(x, s, color="C3", label="stall (training waits)")
        ax.bar(x, [v or 0.0 for v in write], bottom=s, color="C0", label="write")
    whole = [0.0 if split[i] else num(e, "save_seconds") or 0.0 for i, e in enumerate(ckpts)]
    if not all(split):  # saves from a version that did not split stall and write
        ax.bar(x, whole, color="C7", label="whole save")
    ax.legend(fontsize=8)
    ax.set_xticks(list(x), labels if len(labels) <= 30 else [""] * len(labels))
    ax.set(xlabel="checkpoint at step", ylabel="seconds", title="checkpoint saves")
    ax.grid(alpha=0.3, axis="y")
    plot.png = to_png(fig)
    return plot


TIMELINE_ROWS = ("run_start", "checkpoint", "eval", *FAULT_KINDS, "run_end")
_ROW_STYLE = {"run_start": ("g", ">"), "run_end": ("k", "s"), "checkpoint": ("C0", "D"),
              "eval": ("C2", "."), "restart": ("C4", "*"), "resume": ("C4", ">"),
              "rollback": ("tab:red", "<"), "nonfinite": ("tab:orange", "x"),
              "straggler": ("tab:brown", "v"), "hang": ("tab:red", "X"),
              "checkpoint_rejected": ("tab:red", "D")}


def timeline_plot(run: Run) -> Plot:
    plot = Plot("timeline", "Timeline", "Top: the step each logged step event reached, against wall "
                "time (a drop is a restart or rollback re-running steps; a gap is downtime). "
                "Bottom: when each event happened; restarts, rollbacks and hangs also as vertical "
                "lines.")
    timed = [e for e in run.events if num(e, "time") is not None]
    if not timed:
        plot.omitted = "no event carries a time"
        return plot
    fig, (top, bottom) = new_figure(2, 2.6, sharex=True)
    t0 = run.t0
    raw_steps = [(t - t0, s) for e in run.of("step")
                 if (t := num(e, "time")) is not None and (s := num(e, "step")) is not None]
    if raw_steps:
        top.plot(*zip(*raw_steps, strict=True), marker=".", color="C0", lw=1)
    top.set(ylabel="step", title="progress")
    rows = [k for k in TIMELINE_ROWS if run.of(k)]
    for y, kind in enumerate(rows):
        color, marker = _ROW_STYLE.get(kind, ("k", "o"))
        times = [t - t0 for e in run.of(kind) if (t := num(e, "time")) is not None]
        bottom.scatter(times, [y] * len(times), color=color, marker=marker, s=40, zorder=3)
        if kind in ("restart", "rollback", "hang", "resume"):
            for t in times:
                for ax in (top, bottom):
                    ax.axvline(t, color=color, ls=":", lw=1)
    bottom.set_yticks(range(len(rows)), [r.replace("_", " ") for r in rows])
    bottom.set_ylim(-0.7, len(rows) - 0.3)
    faults = sum(len(run.of(k)) for k in FAULT_KINDS)
    bottom.set(xlabel="seconds since the first event",
               title="events" + ("" if faults else " (no restart, straggler, hang or rollback)"))
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    plot.png = to_png(fig)
    return plot


RUN_PLOTS: tuple[Callable[[Run], Plot], ...] = (
    step_time_plot, comm_plot, memory_plot, bubble_plot, optimizer_plot, experts_plot,
    checkpoint_plot, timeline_plot)
