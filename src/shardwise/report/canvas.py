"""What every picture of a report is drawn on: the `Plot` (PNG bytes, or why it was left out), a
figure of the report's width, the PNG, and the helpers the run, comparison and scaling plots
share (series read from events, relaunch marks, byte units, a plot left out when its data is
malformed). matplotlib's object API only (no pyplot): no GUI backend, no global state.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from shardwise.telemetry.readback import Run, finite, num

DPI = 100
WIDTH_IN = 10.0  # every plot is 1000 px wide


@dataclass
class Plot:
    id: str
    title: str
    caption: str = ""
    png: bytes | None = None
    omitted: str = ""  # why there is no picture

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels, as written into the PNG."""
        return _size_of(self.png) if self.png else (0, 0)


def _size_of(png: bytes) -> tuple[int, int]:
    # The IHDR chunk follows the 8-byte signature: length, type, then width and height.
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def new_figure(rows: int, height_in: float = 3.0, cols: int = 1, **kw: Any) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(WIDTH_IN, height_in * rows), dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kw)
    return fig, [ax for row in axes for ax in row]


def to_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def series(events: list[dict[str, Any]], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for e in events:
        xv, yv = num(e, x), num(e, key)
        if xv is not None and finite(yv):
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def integer_x(*axes: Axes) -> None:
    """Steps and ranks are whole numbers: no tick at step 2.5."""
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def by_launch(run: Run, events: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(seconds since the first event, value), with a NaN between launches so no line is drawn
    across the downtime between a crash and the resume."""
    xs: list[float] = []
    ys: list[float] = []
    last = None
    for e in events:
        t, v = num(e, "time"), num(e, key)
        if t is None or not finite(v):
            continue
        launch = run.launch_of(e)
        if last is not None and launch != last:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(t - run.t0)
        ys.append(v)
        last = launch
    return xs, ys


def mark_relaunches(ax: Axes, run: Run, label: bool = True) -> None:
    """Vertical lines where training went on from an earlier step (resume, restart, rollback)."""
    for i, (step, what) in enumerate(run.relaunch_steps()):
        ax.axvline(step, color="tab:red" if what == "rollback" else "tab:purple", ls=":", lw=1.2,
                   label=f"{what} from step {step}" if label and i < 4 else None)


def bytes_unit(values: list[float]) -> tuple[float, str]:
    top = max((abs(v) for v in values if finite(v)), default=0.0)
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return scale, unit
    return 1.0, "bytes"




def finish_step_panels(plot: Plot, fig: Figure, axes: list[Axes], run: Run) -> Plot:
    """Panels stacked over a shared step axis: grid, relaunch marks, integer steps, the PNG."""
    for ax in axes:
        ax.grid(alpha=0.3)
        mark_relaunches(ax, run, label=False)
    axes[-1].set_xlabel("step")
    integer_x(*axes)
    plot.png = to_png(fig)
    return plot



def plot_id(make: Callable[..., Plot]) -> str:
    """`step_time_plot` -> `step-time`: the id its picture has in the page."""
    return make.__name__.removesuffix("_plot").replace("_", "-")


def safely(make: Callable[[Any], Plot], arg: Any) -> Plot:
    """A plot whose data is malformed in a way its own checks did not foresee is left out with
    the reason, so one odd field never costs the reader the rest of the report."""
    try:
        return make(arg)
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError) as err:
        name = plot_id(make)
        return Plot(name, name.replace("-", " ").capitalize(),
                    omitted=f"its data could not be plotted ({type(err).__name__}: {err})")
