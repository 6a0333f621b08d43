"""Pipeline bubble: per pipeline rank, busy and idle time of each step against the schedule's
theoretical bubble.

`StageClock` wraps, on the instances of one `parallel.pipeline.Pipeline` only, the compute calls
the schedule makes — `PipelineStage.forward_one_chunk` (F), `backward_one_chunk` (B, or I = input
gradients only under zero-bubble), `backward_weight_one_chunk` (W) and the schedule's loss (L) —
and the schedule's `step()` (one pipeline step). Point-to-point sends, receives and their waits
happen outside those calls, so per rank and step

    busy = time inside F, L, B/I, W;   idle = step time - busy;   bubble_fraction = idle / step time

with step time from this rank's entry into `step()` to its return (forward and backward of all
micro-batches; the optimizer is outside). Idle time therefore also holds p2p transfer time: on a
real network it is the bubble the schedule leaves plus what communication adds. Nothing is
patched on torch's classes; a few perf_counter calls per micro-batch and stage are the overhead.

Theory (p pipeline ranks, m micro-batches, v stages per rank), equal stage costs:
  gpipe, 1f1b         (p-1) / (m + p-1)
  interleaved-1f1b    (p-1) / (v·m + p-1)        the bubble divided by v
  zero-bubble (ZB-V)  0: the ideal of ZB-V (T_F = T_I = T_W), whose warm-up and cool-down are
                      filled with weight-gradient work. The real ZBV order leaves a small rest at
                      small m (bench_pipeline's "sim unit": 0.14 / 0.04 / 0.02 at p=2, m=2/4/8).
"""

from __future__ import annotations

import time
from typing import Any


def theoretical_bubble(schedule: str, pp: int, m: int, v: int = 1) -> float:
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (v * m + pp - 1)
    if schedule == "zero-bubble":
        return 0.0
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


class StageClock:
    """Times the compute calls and steps of one Pipeline's stages and schedule on this rank.

    Always accumulates `busy_s` / `step_s` / `steps` (read and reset with `drain`); with
    `keep_ops` it also keeps every call as (kind, stage, micro-batch, t0, t1) for analysis
    (benchmarks/bench_pipeline.py replays them).
    """

    def __init__(self, pipeline: Any, keep_ops: bool = False) -> None:
        self.keep_ops = keep_ops
        self.events: list[tuple[str, int, int, float, float]] = []  # kind, stage, mb, t0, t1
        self.steps: list[tuple[float, float]] = []  # (t0, t1) of each schedule step, keep_ops only
        self.busy_s = 0.0
        self.step_s = 0.0
        self.n_steps = 0
        for stage in pipeline.stages:
            self._wrap_stage(stage)
        schedule = pipeline.schedule
        inner_step = schedule.step
        inner_loss = getattr(schedule, "_maybe_compute_loss", None)

        def step(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner_step(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.step_s += t1 - t0
                self.n_steps += 1
                if keep_ops:
                    self.steps.append((t0, t1))

        schedule.step = step
        if inner_loss is not None:  # a private method in torch 2.11-2.13: timed only if present
            def loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any,
                     **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return inner_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
                finally:
                    if stage.is_last:
                        self._record("L", stage.stage_index, mb_index, t0)

            schedule._maybe_compute_loss = loss

    def _record(self, kind: str, stage: int, mb: int, t0: float) -> None:
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        if self.keep_ops:
            self.events.append((kind, stage, mb, t0, t1))

    def _wrap_stage(self, stage: Any) -> None:
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk
        wgt = stage.backward_weight_one_chunk
        sid = stage.stage_index

        def forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fwd(chunk, *args, **kwargs)
            finally:
                self._record("F", sid, chunk, t0)

        def backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            t0 = time.perf_counter()
            try:
                return bwd(chunk, *args, **kwargs)
            finally:
                self._record("B" if full else "I", sid, chunk, t0)

        def weight(chunk: int, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return wgt(chunk, *args, **kwargs)
            finally:
                self._record("W", sid, chunk, t0)

        stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
        stage.backward_weight_one_chunk = weight

    def drain(self) -> tuple[float, float, int]:
        """(busy seconds, step seconds, steps) since the last drain."""
        out = (self.busy_s, self.step_s, self.n_steps)
        self.busy_s, self.step_s, self.n_steps = 0.0, 0.0, 0
        return out

    def step_records(self) -> list[dict[str, Any]]:
        """Per step (keep_ops): its span, busy time and calls as (kind, stage, mb, seconds)."""
        out = []
        for t0, t1 in self.steps:
            ops = [(k, s, mb, b - a) for k, s, mb, a, b in self.events if t0 <= a and b <= t1]
            out.append({"t0": t0, "t1": t1, "busy": sum(op[3] for op in ops), "ops": ops})
        return out
