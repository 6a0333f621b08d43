"""What watches every step of a run: communication counting, the flight recorder and hang
watchdog, straggler detection, the timeline trace and per-window step statistics.

The trainer calls `begin_step`, `phase` and `end_step`; at each log step `window_fields` returns the
step-event fields measured since the previous one (a collective: every rank contributes its own
figures). Everything here is per process and built from the run's spec and DistContext — no global
state beyond the one installed comm tap.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.compat import TorchPatches
from shardwise.parallel.distributed import DistContext
from shardwise.resilience.flight import FlightRecorder, flight_dir, read_flight
from shardwise.resilience.hang import Diagnosis
from shardwise.resilience.watchdog import Watchdog
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog
from shardwise.telemetry.comm.groups import axes_of
from shardwise.telemetry.comm.tap import CommTap
from shardwise.telemetry.comm.totals import OpTotals, StepComm
from shardwise.telemetry.energy import EnergyMeter, energy_fields
from shardwise.telemetry.straggler import StragglerDetector
from shardwise.telemetry.trace import StepTrace

Gather = Callable[[list[float]], list[list[float]]]


#: how long a log step waits for device timings when none of its window's steps has resolved
LATE_WAIT_S = 10.0


@dataclass(frozen=True)
class StepSample:
    step_s: float
    data_wait_s: float
    comm: StepComm  # device-timed collectives may resolve after the step ended

    @property
    def compute_s(self) -> float:
        """Step time minus time with a collective in flight."""
        return max(0.0, self.step_s - self.comm.inflight_s)


class Monitors:
    def __init__(self, spec: RunSpec, ctx: DistContext, run_dir: Path, events: EventLog,
                 attempt: int, patches: TorchPatches | None = None) -> None:
        """`patches`: the worker's runtime, through which the comm tap wraps torch's
        collectives (the tap keeps a scope of its own without one)."""
        self.spec, self.ctx, self.events, self.attempt = spec, ctx, events, attempt
        self.recorder: FlightRecorder | None = None
        self.tap: CommTap | None = None
        self.watchdog: Watchdog | None = None
        self.directory = flight_dir(run_dir, attempt)
        if ctx.distributed:
            self.recorder = FlightRecorder(self.directory, ctx.rank, ctx.world_size)
            if spec.telemetry.comm:
                axes = axes_of(ctx.mesh, ctx.dp_mesh)
                for name, mesh in (("dp_cp", ctx.dp_cp_mesh), ("dp_shard_cp", ctx.fsdp_cp_mesh)):
                    if mesh is not None and mesh.ndim == 1:  # context parallel's gradient groups
                        axes[mesh.get_group().group_name] = name
                self.tap = CommTap(axes, self.recorder).install(patches)
            if spec.failure.hang_timeout_s > 0:
                # the watchdog also resolves device-timed completions (progress) while the
                # training thread is blocked on the device
                poll = functools.partial(self.tap.poll, block=False) if self.tap else None
                self.watchdog = Watchdog(self.recorder, spec.failure.hang_timeout_s,
                                         ctx.world_size, on_fire=self._on_hang, poll=poll)
        t = spec.telemetry
        self.trace = StepTrace(run_dir / "trace" / f"rank-{ctx.rank}.json", ctx.rank,
                               t.trace_from, t.trace_steps)
        if self.tap is not None:
            self.tap.on_span = self.trace.collective
        self.stragglers = StragglerDetector(spec.failure.straggler_factor,
                                            spec.failure.straggler_windows)
        # this rank's GPU and (first local rank) host energy counters; read at each log step
        self.energy = EnergyMeter.for_rank(ctx.device.type, ctx.device.index, ctx.local_rank)
        self._energy_said = False
        self.window: list[StepSample] = []
        self.productive_s = 0.0  # time inside training steps, for goodput
        self.started = time.time()
        self._t0 = 0.0
        self._data_t = 0.0
        self.current_straggler: str = ""
        self.min_wire_bytes: float | None = None  # the layout's theoretical minimum per step

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.energy.start()
        if self.watchdog is not None:
            self.watchdog.start()

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.tap is not None:
            self.tap.poll(wait_s=2.0)  # the last device timings (bounded: a failed run's never come)
            self.tap.uninstall()
        if self.recorder is not None:
            self.recorder.close()

    def paused(self) -> Any:
        """The watchdog steps aside (checkpoint writes run long without collectives)."""
        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    # --- per step -----------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._t0 = time.perf_counter()
        self._data_t = 0.0
        if self.tap is not None:
            self.tap.begin_step(step)
        if self.recorder is not None:
            self.recorder.progress(step, "data")
        self.trace.begin_step(step)
        self.trace.phase("data")

    def phase(self, name: str, step: int) -> None:
        if name == "forward" and self._data_t == 0.0:
            self._data_t = time.perf_counter() - self._t0
        if self.recorder is not None:
            self.recorder.progress(step, name)
        self.trace.phase(name)

    def end_step(self, step: int) -> float:
        """Close the step; returns its wall time."""
        step_s = time.perf_counter() - self._t0
        comm = self.tap.end_step() if self.tap is not None else StepComm()
        self.window.append(StepSample(step_s, self._data_t, comm))
        self.trace.end_step()
        if self.recorder is not None:
            self.recorder.progress(step, "hook")
        self.productive_s += step_s
        return step_s

    # --- per log window -----------------------------------------------------------------------
    def window_fields(self, step: int, gather: Gather) -> dict[str, Any]:
        """Step-event fields for the window since the last call (collective on every rank)."""
        window = self._take_window()
        if not window:
            return {}
        times = [s.step_s for s in window]
        compute = statistics.median(s.compute_s for s in window)
        comm_bytes = sum(s.comm.bytes for s in window) / len(window)
        wire = sum(s.comm.wire_bytes for s in window) / len(window)
        comm_time = sum(s.comm.time_s for s in window) / len(window)
        local = [statistics.median(times), *_percentiles(times), compute, comm_bytes, comm_time,
                 statistics.mean(s.data_wait_s for s in window), *self.energy.take()]
        rows = gather(local)  # one row per rank
        cols = list(zip(*rows, strict=True))
        fields: dict[str, Any] = {
            "step_time_s": max(cols[0]),  # the step takes as long as the slowest rank
            "step_time_s_per_rank": _r(cols[0]),
            "step_time_p50_s_per_rank": _r(cols[1]),
            "step_time_p90_s_per_rank": _r(cols[2]),
            "step_time_p99_s_per_rank": _r(cols[3]),
            "compute_s_per_rank": _r(cols[4]),
            "data_wait_s": round(max(cols[7]), 6),
            **energy_fields(list(cols[8]), list(cols[9]), cols[10][0]),
        }
        self._say_energy(step, fields)
        if self.tap is not None:
            by_op: dict[str, OpTotals] = {}
            for sample in window:
                for key, t in sample.comm.by_op.items():
                    by_op.setdefault(key, OpTotals()).add(t.calls, t.bytes, t.wire_bytes,
                                                          t.time_s)
            n = len(window)
            fields.update(
                comm_bytes=round(comm_bytes), comm_wire_bytes=round(wire),
                comm_time_s=round(comm_time, 6), comm_bytes_per_rank=[round(v) for v in cols[5]],
                comm_ratio_to_min=round(wire / self.min_wire_bytes, 6)
                if self.min_wire_bytes else None,
                comm_by_op={k: {"calls": v.calls / n, "bytes": round(v.bytes / n),
                                "wire_bytes": round(v.wire_bytes / n),
                                "time_s": round(v.time_s / n, 6)}
                            for k, v in sorted(by_op.items())})
        found = self.stragglers.observe(list(cols[4]))
        self.current_straggler = "; ".join(s.describe() for s in found)
        for s in found:
            self.events.emit("straggler", step, straggler_rank=s.rank, ratio=round(s.ratio, 3),
                             compute_s=round(s.compute_s, 6), median_s=round(s.median_s, 6),
                             message=s.describe())
        return fields

    def _say_energy(self, step: int, fields: dict[str, Any]) -> None:
        """Once per launch, rank 0 says what energy is measured, or why none is."""
        if self._energy_said or not self.ctx.is_main:
            return
        self._energy_said = True
        self.events.emit("energy", step, source=fields.get("energy_source"),
                         note="; ".join(self.energy.notes) or None)

    def _take_window(self) -> list[StepSample]:
        """The window's steps whose device timings have resolved; the others wait for the next
        window — unless none has, then this waits for them (bounded), so that no rank skips the
        window's gather."""
        window, self.window = self.window, []
        if self.tap is None or not window or self.tap.poll() == 0:
            return window
        ready = [s for s in window if s.comm.resolved]
        if not ready:
            self.tap.poll(wait_s=LATE_WAIT_S)
            return window
        self.window = [s for s in window if not s.comm.resolved]
        return ready

    def goodput(self) -> float:
        """Productive step time / wall time since this process started."""
        from shardwise.meta import STARTED_AT

        wall = time.time() - STARTED_AT
        return round(self.productive_s / wall, 4) if wall > 0 else 0.0

    def previous_attempt_step(self) -> int | None:
        """The step rank 0 was in when the previous restart attempt ended (None on attempt 0)."""
        if self.attempt == 0:
            return None
        flight = read_flight(flight_dir(self.directory.parent.parent, self.attempt - 1)
                             / "rank-0.bin")
        return flight.step if flight is not None else None

    def _on_hang(self, diagnosis: Diagnosis, text: str) -> None:
        self.events.emit("hang", self.recorder.step if self.recorder else 0, ranks=diagnosis.ranks,
                         report=text, attempt=self.attempt)
        self.events.close()


def _percentiles(values: list[float]) -> list[float]:
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
            for q in (0.5, 0.9, 0.99)]


def _r(values: Any) -> list[float]:
    return [round(float(v), 6) for v in values]


def gather_rows(ctx: DistContext) -> Gather:
    """All ranks' float vectors, in rank order (one all-gather)."""
    import torch.distributed as dist

    def gather(values: list[float]) -> list[list[float]]:
        if not ctx.distributed:
            return [values]
        t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
        out = [torch.zeros_like(t) for _ in range(ctx.world_size)]
        dist.all_gather(out, t)
        return [[float(x) for x in row] for row in out]

    return gather
