"""Read a run's `metrics.jsonl` back into events the report can plot and `compare` can score
(beside the event log that writes them, below both readers).

The file is what a run left behind, possibly after crashes: a last line cut off mid-write, several
launches appended (resume, elastic restart), steps that go back (rollback, restart). Reading never
fails on those; it records a note the report shows. Only input with nothing to report (no
directory, no file, no readable event) is a `UserError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from shardwise.errors import UserError

METRICS = "metrics.jsonl"

#: Event kinds that mark something going wrong or being recovered, in timeline order of rows.
FAULT_KINDS = ("restart", "resume", "rollback", "nonfinite", "straggler", "hang", "checkpoint_rejected")


@dataclass
class Run:
    """All events of one run directory, in file order, plus what reading them noticed."""

    run_dir: Path
    events: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    _launch_ids: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.run_dir.name

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind]

    @property
    def launches(self) -> list[dict[str, Any]]:
        """One `run_start` per launch (fresh start, resume or restart)."""
        return self.of("run_start")

    @property
    def start(self) -> dict[str, Any]:
        """The latest launch's `run_start` (its layout is the one the run ended in), or {}."""
        starts = self.launches
        return starts[-1] if starts else {}

    @property
    def t0(self) -> float:
        """Wall time of the first event: the origin of every time axis."""
        times = [t for e in self.events if (t := num(e, "time")) is not None]
        return min(times) if times else 0.0

    def launch_spans(self) -> list[tuple[float, float]]:
        """(first, last) event time of each launch. A launch begins at its run_start, or at the
        resume and checkpoint_rejected events that resuming writes just before it."""
        starts = [i for i, e in enumerate(self.events) if e.get("kind") == "run_start"]
        bounds = []
        for i in starts:
            while i > 0 and self.events[i - 1].get("kind") in ("resume", "checkpoint_rejected"):
                i -= 1
            bounds.append(i)
        if not bounds or bounds[0] != 0:
            bounds.insert(0, 0)
        spans = []
        for lo, hi in zip(bounds, [*bounds[1:], len(self.events)], strict=True):
            times = [t for e in self.events[lo:hi] if (t := num(e, "time")) is not None]
            if times:
                spans.append((min(times), max(times)))
        return spans

    def launch_of(self, event: dict[str, Any]) -> int:
        """Which launch (0, 1, ...) wrote `event`: the number of run_start events before it."""
        if not self._launch_ids:
            n = -1
            for e in self.events:
                n += e.get("kind") == "run_start"
                self._launch_ids[id(e)] = max(n, 0)
        return self._launch_ids.get(id(event), 0)

    def last_per_step(self, kind: str) -> list[dict[str, Any]]:
        """Events of `kind` by step, keeping the last one written for each step: after a rollback
        or restart re-runs steps, the re-run is what the model's history consists of."""
        by_step: dict[int, dict[str, Any]] = {}
        for event in self.of(kind):
            step = event.get("step")
            if isinstance(step, int):
                by_step[step] = event
        return [by_step[s] for s in sorted(by_step)]

    def steps(self) -> list[dict[str, Any]]:
        return self.last_per_step("step")

    def evals(self) -> list[dict[str, Any]]:
        return self.last_per_step("eval")

    def relaunch_steps(self) -> list[tuple[int, str]]:
        """(step, label) where training went on from an earlier point: every launch after the
        first, and every rollback."""
        marks = [(int(e.get("step") or 0), "resume" if i else "start")
                 for i, e in enumerate(self.launches)][1:]
        marks += [(int(e.get("step") or 0), "rollback") for e in self.of("rollback")]
        return sorted(marks)


def num(event: dict[str, Any], key: str) -> float | None:
    """A numeric field as float, or None when absent or not a number. Non-finite floats were
    written as strings ("nan", "inf") because JSON has no such numbers."""
    value = event.get(key)
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def finite(value: float | None) -> TypeGuard[float]:
    """A number that can be plotted and averaged (not None, NaN or infinite)."""
    return value is not None and math.isfinite(value)


def num_list(event: dict[str, Any], key: str) -> list[float] | None:
    """A per-rank list as floats (None entries become NaN), or None when absent."""
    value = event.get(key)
    if not isinstance(value, list) or not value:
        return None
    out = [num({"v": v}, "v") for v in value]
    return [math.nan if v is None else v for v in out]


def resolve_metrics(path_text: str) -> tuple[Path, Path]:
    """(run directory, metrics file) for a run directory or a metrics.jsonl path."""
    path = Path(path_text).expanduser()
    if path.is_file() and path.suffix == ".jsonl":
        return path.parent, path
    if not path.exists():
        raise UserError(f"{path_text} does not exist. Pass a run directory made by `shardwise "
                        f"train` (runs/NAME), which holds {METRICS}.")
    if not path.is_dir():
        raise UserError(f"{path_text} is a file, not a run directory. Pass the directory made by "
                        f"`shardwise train` (runs/NAME), or its {METRICS}.")
    metrics = path / METRICS
    if not metrics.is_file():
        raise UserError(f"{path_text} has no {METRICS}: it is not a run directory, or its run "
                        "stopped before rank 0 wrote the first event (see the run's own output "
                        "for why).")
    return path, metrics


def load_run(path_text: str) -> Run:
    run_dir, metrics = resolve_metrics(path_text)
    try:
        text = metrics.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise UserError(f"cannot read {metrics}: {err.strerror or err}.") from None
    lines = text.split("\n")
    events: list[dict[str, Any]] = []
    bad: list[int] = []
    truncated = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            # The last line without a newline is a write the run did not finish (it crashed or
            # was killed mid-line); anything else is damage worth naming by line number.
            if number == len(lines) and not text.endswith("\n"):
                truncated = True
            else:
                bad.append(number)
            continue
        if isinstance(event, dict) and isinstance(event.get("kind"), str):
            events.append(event)
        else:
            bad.append(number)
    if not events:
        what = "is empty" if not text.strip() else "has no readable event"
        raise UserError(f"{metrics} {what}: the run stopped before rank 0 logged anything, so "
                        "there is nothing to report. Check the run's own output for why it "
                        "stopped, or train longer than one log interval (log.every).")
    run = Run(run_dir, events)
    if truncated:
        run.notes.append(f"The last line of {METRICS} (line {len(lines)}) is cut off: the run "
                         "stopped while writing it. That event is left out.")
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (" …" if len(bad) > 10 else "")
        run.notes.append(f"{len(bad)} line(s) of {METRICS} are not events and are left out "
                         f"(line {shown}).")
    if not run.of("run_start"):
        run.notes.append("No run_start event: layout, world size and model size are unknown.")
    return run
