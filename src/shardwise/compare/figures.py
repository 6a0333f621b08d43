"""The figures of one run that a scorecard puts side by side, each read from the run's events with
one stated rule (docs/comparisons.md lists them), so a number in a scorecard can be checked
against metrics.jsonl by hand.

Time is training time: from each launch's first event to its last, the downtime between a crash
and its resume left out; the start-up before a launch's first event (process start, data, model
build) is its own figure (`run_end.startup_s`). Throughput-like figures use the steady log
windows: every logged step but the first of each launch, which carries the warm-up.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from shardwise.compare.runs import RunData, final_tokens
from shardwise.telemetry.readback import Run, finite, num, num_list


@dataclass(frozen=True)
class EvalPoint:
    step: int
    tokens: float | None  # tokens trained when it was taken
    seconds: float  # training time when it was taken
    loss: float


@dataclass(frozen=True)
class TargetHit:
    """The first evaluation at or below the target loss."""

    step: int
    tokens: float | None
    seconds: float
    loss: float
    energy_j: float | None  # measured energy up to that evaluation, where measured
    device_hours: float


@dataclass
class RunFigures:
    name: str
    device: str
    world_size: int | None
    evals: list[EvalPoint]
    tokens: int | None
    tokens_per_s: list[float]  # one per steady log window
    mfu: list[float]
    step_time_s: list[float]  # the slowest rank's median, per window
    step_p99_s: list[float]  # the slowest rank's p99, per window
    straggler_ratio: float | None  # worst window: slowest rank's compute time / the median rank's
    straggler_events: int
    peak_device_bytes: float | None  # GPU: max allocated
    peak_reserved_bytes: float | None  # GPU: max reserved
    peak_host_bytes: float | None  # CPU runs: the process's peak RSS
    comm_bytes: float | None  # per rank per step, median window
    comm_time_s: float | None
    comm_share: float | None  # time in collectives / step time, median window
    checkpoints: int
    checkpoint_bytes: float
    checkpoint_write_s: float
    checkpoint_stall_s: float
    restart_s: list[float]  # seconds to the first step of each restart
    goodput: float | None
    training_s: float
    startup_s: float | None
    device_seconds: float
    energy_j: float | None
    energy_source: str  # "" where nothing was measured
    energy_note: str  # why not, when not
    target: TargetHit | None = None
    best_loss: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def device_hours(self) -> float:
        return self.device_seconds / 3600

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def figures_of(data: RunData, target_loss: float | None) -> RunFigures:
    run = data.run
    timeline = Timeline(run)
    evals = eval_points(run, timeline)
    steady = steady_steps(run)
    checkpoints = run.of("checkpoint")
    energy = [v for e in run.steps() if finite(v := num(e, "energy_j"))]
    energy_events = run.of("energy")
    figures = RunFigures(
        name=data.name, device=str(run.start.get("device", "")),
        world_size=_int(num(run.start, "world_size")), evals=evals, tokens=final_tokens(run),
        tokens_per_s=_values(steady, "tokens_per_s"), mfu=_values(steady, "mfu"),
        step_time_s=_values(steady, "step_time_s"),
        step_p99_s=[max(ranks) for e in steady
                    if (ranks := _finite_list(e, "step_time_p99_s_per_rank"))],
        straggler_ratio=straggler_ratio(steady), straggler_events=len(run.of("straggler")),
        peak_device_bytes=None, peak_reserved_bytes=None, peak_host_bytes=None,
        comm_bytes=_median(_values(steady, "comm_bytes")),
        comm_time_s=_median(_values(steady, "comm_time_s")),
        comm_share=_median([c / s for e in steady if finite(c := num(e, "comm_time_s"))
                            and finite(s := num(e, "step_time_s")) and s > 0]),
        checkpoints=len(checkpoints),
        checkpoint_bytes=sum(num(e, "bytes") or 0.0 for e in checkpoints),
        checkpoint_write_s=sum(num(e, "write_s") or num(e, "save_seconds") or 0.0
                               for e in checkpoints),
        checkpoint_stall_s=sum(num(e, "stall_s") or 0.0 for e in checkpoints),
        restart_s=[v for e in run.of("restart") if finite(v := num(e, "seconds_to_first_step"))],
        goodput=goodput(run), training_s=timeline.total_s, startup_s=startup_s(run),
        device_seconds=timeline.device_seconds + _startup_device_s(run),
        energy_j=sum(energy) if energy else None,
        energy_source="+".join(sorted({str(e.get("energy_source")) for e in run.steps()
                                       if e.get("energy_source")})),
        energy_note=str(energy_events[-1].get("note") or "") if energy_events else "",
    )
    _memory(figures, run)
    losses = [p.loss for p in evals]
    figures.best_loss = min(losses) if losses else None
    if target_loss is not None:
        figures.target = target_hit(run, evals, target_loss, timeline)
    return figures


class Timeline:
    """Training time and device time of a run, launch by launch."""

    def __init__(self, run: Run) -> None:
        self.spans: list[tuple[float, float, int]] = []  # (first, last, world size) per launch
        by_launch: dict[int, list[float]] = {}
        for event in run.events:
            t = num(event, "time")
            if t is not None:
                by_launch.setdefault(run.launch_of(event), []).append(t)
        worlds = [_int(num(s, "world_size")) or 1 for s in run.launches] or [1]
        for launch, times in sorted(by_launch.items()):
            self.spans.append((min(times), max(times), worlds[min(launch, len(worlds) - 1)]))

    @property
    def total_s(self) -> float:
        return sum(hi - lo for lo, hi, _ in self.spans)

    @property
    def device_seconds(self) -> float:
        return sum((hi - lo) * world for lo, hi, world in self.spans)

    def elapsed(self, t: float) -> float:
        """Training seconds from the run's first event to wall time `t`."""
        return sum(max(0.0, min(hi, t) - lo) for lo, hi, _ in self.spans if lo <= t)

    def device_seconds_at(self, t: float) -> float:
        return sum(max(0.0, min(hi, t) - lo) * world for lo, hi, world in self.spans if lo <= t)


def eval_points(run: Run, timeline: Timeline) -> list[EvalPoint]:
    """Every held-out evaluation (the last one written for each step), with the tokens trained
    by then: the step event's `tokens_seen`, else step x `tokens_per_step`."""
    tokens_at = {int(e["step"]): t for e in run.steps() if finite(t := num(e, "tokens_seen"))}
    per_step = num(run.start, "tokens_per_step")
    points = []
    for e in run.evals():
        loss, t, step = num(e, "val_loss"), num(e, "time"), e.get("step")
        if not finite(loss) or t is None or not isinstance(step, int):
            continue
        tokens = tokens_at.get(step, step * per_step if finite(per_step) else None)
        points.append(EvalPoint(step, tokens, timeline.elapsed(t), loss))
    return points


def target_hit(run: Run, evals: list[EvalPoint], target: float, timeline: Timeline
               ) -> TargetHit | None:
    """The first evaluation (by step) whose held-out loss is at or below `target`."""
    for point in evals:
        if point.loss <= target:
            t = next(num(e, "time") for e in run.evals() if e.get("step") == point.step)
            assert t is not None
            energy = [v for e in run.steps() if finite(v := num(e, "energy_j"))
                      and (num(e, "time") or math.inf) <= t]
            return TargetHit(point.step, point.tokens, point.seconds, point.loss,
                             sum(energy) if energy else None,
                             (timeline.device_seconds_at(t) + _startup_device_s(run)) / 3600)
    return None


def steady_steps(run: Run) -> list[dict[str, Any]]:
    """The step events (the last written per step) without the first logged step of each launch;
    a launch that logged only one step keeps it."""
    steps = run.steps()
    firsts: dict[int, int] = {}
    counts: dict[int, int] = {}
    for e in steps:
        launch = run.launch_of(e)
        firsts.setdefault(launch, int(e["step"]))
        counts[launch] = counts.get(launch, 0) + 1
    return [e for e in steps if not (int(e["step"]) == firsts[run.launch_of(e)]
                                     and counts[run.launch_of(e)] > 1)]


def straggler_ratio(steps: list[dict[str, Any]]) -> float | None:
    """The worst window's slowest-rank compute time over the median rank's (1.0: balanced)."""
    ratios = []
    for e in steps:
        values = _finite_list(e, "compute_s_per_rank")
        if values and len(values) > 1 and (med := statistics.median(values)) > 0:
            ratios.append(max(values) / med)
    return max(ratios) if ratios else None


def goodput(run: Run) -> float | None:
    """Time inside training steps over wall time, over all launches (each launch's run_end
    goodput weighted by its wall time)."""
    ends = [(g, w) for e in run.of("run_end") if finite(g := num(e, "goodput"))
            and finite(w := num(e, "wall_s"))]
    total = sum(w for _, w in ends)
    if not ends:
        return None
    return sum(g * w for g, w in ends) / total if total > 0 else ends[-1][0]


def startup_s(run: Run) -> float | None:
    values = [v for e in run.of("run_end") if finite(v := num(e, "startup_s"))]
    return sum(values) if values else None


def _startup_device_s(run: Run) -> float:
    """Device-seconds held before each launch's first event (where run_end recorded it)."""
    total = 0.0
    for e in run.of("run_end"):
        if finite(v := num(e, "startup_s")) and run.launches:
            start = run.launches[min(run.launch_of(e), len(run.launches) - 1)]
            total += v * (_int(num(start, "world_size")) or 1)
    return total


def _memory(figures: RunFigures, run: Run) -> None:
    peaks = [v for e in run.steps() if finite(v := num(e, "peak_mem_bytes"))]
    reserved = [max(ranks) for e in run.steps()
                if (ranks := _finite_list(e, "peak_reserved_bytes_per_rank"))]
    if figures.on_gpu:
        figures.peak_device_bytes = max(peaks, default=None)
        figures.peak_reserved_bytes = max(reserved, default=None)
    else:
        figures.peak_host_bytes = max(peaks, default=None)


def _values(events: list[dict[str, Any]], key: str) -> list[float]:
    return [v for e in events if finite(v := num(e, key))]


def _finite_list(event: dict[str, Any], key: str) -> list[float]:
    return [v for v in (num_list(event, key) or []) if finite(v)]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _int(value: float | None) -> int | None:
    return None if value is None or not math.isfinite(value) else int(value)
