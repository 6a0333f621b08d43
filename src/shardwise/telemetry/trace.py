"""A Chrome / Perfetto trace of a window of steps, per rank: `RUN_DIR/trace/rank-K.json`.

Spans: the step, its phases (data, forward, backward, optimizer — from the trainer's phase marks:
a phase lasts until the next mark) and every counted collective (from the comm tap) on a second
track. Times are wall-clock microseconds, so the ranks' files line up when loaded together
(chrome://tracing or ui.perfetto.dev, "Open trace file").
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from shardwise.utils.files import atomic_write_text


class StepTrace:
    def __init__(self, path: Path, rank: int, first_step: int, steps: int) -> None:
        self.path, self.rank = path, rank
        self.first, self.last = first_step, first_step + steps - 1
        self.events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1,
             "args": {"name": "collectives"}},
        ]
        # perf_counter for precision, shifted onto the wall clock so ranks align
        self._offset = time.time() - time.perf_counter()
        self._step: int | None = None
        self._step_t0 = 0.0
        self._phase: tuple[str, float] | None = None
        self.done = steps <= 0

    def _us(self, t: float) -> float:
        return round((t + self._offset) * 1e6, 1)

    def active(self, step: int) -> bool:
        return not self.done and self.first <= step <= self.last

    def begin_step(self, step: int) -> None:
        if self.active(step):
            self._step, self._step_t0 = step, time.perf_counter()

    def phase(self, name: str) -> None:
        if self._step is None:
            return
        now = time.perf_counter()
        self._close_phase(now)
        self._phase = (name, now)

    def _close_phase(self, now: float) -> None:
        if self._phase is not None:
            name, t0 = self._phase
            self.events.append({"ph": "X", "name": name, "pid": self.rank, "tid": 0,
                                "ts": self._us(t0), "dur": round((now - t0) * 1e6, 1),
                                "args": {"step": self._step}})
            self._phase = None

    def collective(self, op: str, axis: str, nbytes: int, t0: float, t1: float) -> None:
        if self._step is None:
            return
        self.events.append({"ph": "X", "name": f"{op} [{axis}]", "pid": self.rank, "tid": 1,
                            "ts": self._us(t0), "dur": round((t1 - t0) * 1e6, 1),
                            "args": {"bytes": nbytes, "axis": axis, "step": self._step}})

    def end_step(self) -> None:
        if self._step is None:
            return
        now = time.perf_counter()
        self._close_phase(now)
        self.events.append({"ph": "X", "name": f"step {self._step}", "pid": self.rank, "tid": 0,
                            "ts": self._us(self._step_t0),
                            "dur": round((now - self._step_t0) * 1e6, 1)})
        if self._step >= self.last:
            self.write()
        self._step = None

    def write(self) -> None:
        self.done = True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"traceEvents": self.events,
                                                 "displayTimeUnit": "ms"}))
