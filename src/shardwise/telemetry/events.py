"""Typed events and the sinks they go to.

Every measurement is an event (`kind`: run_start, step, eval, checkpoint, sample, run_end) with run
id, rank, step and wall time; sinks decide where it goes (JSONL file, TensorBoard, progress bar).
Only rank 0 has sinks, so other ranks stay quiet; per-rank figures are gathered into rank 0's
events by the code that measures them.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Protocol

from shardwise.utils.redact import redact


class Sink(Protocol):
    def write(self, event: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class EventLog:
    def __init__(self, run_id: str, rank: int, sinks: list[Sink]) -> None:
        self.run_id, self.rank, self.sinks = run_id, rank, sinks

    def emit(self, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "run_id": self.run_id, "rank": self.rank, "step": step,
                 "time": round(time.time(), 3), **fields}
        for sink in self.sinks:
            sink.write(event)
        return event

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class JsonlSink:
    """One JSON object per line, flushed per event so a crash loses nothing already measured."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(_finite(_redacted(event)), sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Numeric fields of step and eval events as scalars `<kind>/<field>`."""

    SKIP = frozenset({"step", "rank", "time", "run_id"})

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(logdir))

    def write(self, event: dict[str, Any]) -> None:
        if event["kind"] not in ("step", "eval"):
            return
        for key, value in event.items():
            if key in self.SKIP or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                self._writer.add_scalar(f"{event['kind']}/{key}", value, event["step"])

    def close(self) -> None:
        self._writer.close()


def _redacted(value: Any) -> Any:
    """Credentials in any URI an event quotes (an error's text, say) as ***: metrics.jsonl is
    read and shared by people who must not learn them."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted(v) for v in value]
    return value


def _finite(event: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/Infinity: write them as strings so every line stays valid JSON."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in event.items()}
