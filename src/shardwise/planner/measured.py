"""Runs that happened, read back, and the planner's prediction of each against its measurement.
Imports no torch (the model's `ModelDims` come from the caller).

A run directory holds `spec.toml` and `metrics.jsonl` (the `run_start`, `model_state`, `memory` and
`step` events, docs/telemetry.md "Events"). What is compared:

- **model state**: the rank with the most parameter + gradient + optimizer bytes
  (`model_state` event: param_bytes, grad_bytes, optimizer_bytes) against
  `MemoryBreakdown.model_state` of the rank the planner says holds the most.
- **peak**: on a CPU run, the last step event's `peak_mem_bytes_per_rank` (the process's peak RSS,
  VmHWM) minus that rank's `rss_before_model_bytes_per_rank` (the `memory` event): the
  increment the model, its optimizer and its activations explain, against the prediction less
  `CostParams.cpu_runtime_overhead_bytes` (what the process held before the model: not the
  model's to explain). On a GPU run, the largest `peak_mem_bytes` of any step window
  (`max_memory_allocated`) against the prediction less fragmentation and runtime overhead
  (neither is allocated by tensors). A CPU run written before the baseline was recorded is
  compared as a whole (peak RSS against the prediction with its overhead).
- **step time**: the median of the step events' `step_time_s` (the slowest rank's median over
  each log window) from step 2 on — the first step pays for lazy initialisation and DDP's
  bucket rebuild — against `Prediction.step_time_s`.

The fit of the cost parameters to these runs is `planner/calibrate.py`; their TOML file,
`planner/params_file.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, UserError
from shardwise.planner.cost import CostParams, Prediction, predict
from shardwise.planner.layout import Batch, Layout, batch_of, layout_of
from shardwise.planner.models import ModelDims
from shardwise.spec.cluster import ClusterSpec
from shardwise.spec.runspec import RunSpec


@dataclass(frozen=True)
class RunRecord:
    """What one run directory says about itself."""

    path: Path
    spec: RunSpec
    world: int
    device: str  # "cpu" | "cuda"
    layout: Layout
    batch: Batch
    step_time_s: float  # median step time from step 2 on (see the module docstring)
    steps_timed: int
    model_state_bytes: float  # the rank with the most params + grads + optimizer state
    peak_bytes: float | None  # CPU: peak RSS - RSS before the model; GPU: peak allocated
    peak_is_increment: bool  # False: a CPU peak without a baseline (compared whole)
    peak_bytes_per_rank: tuple[float, ...] = ()  # CPU: each rank's figure of `peak_bytes`


@dataclass(frozen=True)
class RunError:
    """One run's prediction against its measurement (errors are (predicted - measured) /
    measured)."""

    run: RunRecord
    prediction: Prediction
    model_state_pred: float
    peak_pred: float | None
    step_time_pred: float

    @property
    def model_state_error(self) -> float:
        return relative_error(self.model_state_pred, self.run.model_state_bytes)

    @property
    def peak_error(self) -> float | None:
        if self.peak_pred is None or not self.run.peak_bytes:
            return None
        return relative_error(self.peak_pred, self.run.peak_bytes)

    @property
    def step_time_error(self) -> float:
        return relative_error(self.step_time_pred, self.run.step_time_s)

    def as_dict(self) -> dict[str, Any]:
        r = self.run
        return {"run": str(r.path), "layout": r.layout.name(), "world": r.world,
                "device": r.device, "micro_batch": r.layout.micro_batch,
                "recompute": r.layout.recompute,
                "model_state_bytes": {"predicted": self.model_state_pred,
                                      "measured": r.model_state_bytes,
                                      "error": self.model_state_error},
                "peak_bytes": {"predicted": self.peak_pred, "measured": r.peak_bytes,
                               "error": self.peak_error,
                               "what": _peak_what(r)},
                "step_time_s": {"predicted": self.step_time_pred, "measured": r.step_time_s,
                                "error": self.step_time_error, "steps": r.steps_timed}}


def relative_error(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else math.inf


def _peak_what(r: RunRecord) -> str:
    if r.device == "cpu":
        return ("peak RSS - RSS before the model" if r.peak_is_increment
                else "peak RSS (no baseline recorded)")
    return "peak allocated"


# --- reading a run directory --------------------------------------------------------------------

def _bad(path: Path, problem: str) -> UserError:
    return UserError(
        f"--calibrate {path}: {problem}. A run directory to calibrate on is one `shardwise train` "
        "wrote: spec.toml and metrics.jsonl with a run_start event, the model_state event of the "
        "first step and at least one step event (log.every no larger than the steps run). Pass "
        "directories of finished runs.")


def read_run(path: str | Path) -> RunRecord:
    """A `RunRecord` from a run directory; a `UserError` naming what is missing otherwise."""
    from shardwise.spec import load_spec

    path = Path(path).expanduser()
    if not path.is_dir():
        raise _bad(path, "no such directory")
    spec_path, metrics_path = path / "spec.toml", path / "metrics.jsonl"
    for needed in (spec_path, metrics_path):
        if not needed.is_file():
            raise _bad(path, f"there is no {needed.name}")
    try:
        spec = load_spec(spec_path)
    except SpecError as err:
        raise _bad(path, f"its spec.toml does not load ({err})") from None
    start: dict[str, Any] | None = None
    state: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    steps: list[dict[str, Any]] = []
    try:
        lines = metrics_path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise _bad(path, f"metrics.jsonl is not readable ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            if number == len(lines):  # a run killed while writing its last line
                continue
            raise _bad(path, f"metrics.jsonl line {number} is not JSON") from None
        kind = event.get("kind") if isinstance(event, dict) else None
        if kind == "run_start":
            start = event  # the last launch's (a resumed run has several)
        elif kind == "model_state" and state is None:
            state = event
        elif kind == "memory" and memory is None:
            memory = event
        elif kind == "step" and isinstance(event.get("step_time_s"), int | float):
            steps.append(event)
    if start is None:
        raise _bad(path, "metrics.jsonl has no run_start event")
    if state is None:
        raise _bad(path, "metrics.jsonl has no model_state event (the run ended before its "
                         "first step)")
    if not steps:
        raise _bad(path, "metrics.jsonl has no step event with a step_time_s")
    try:
        layout = _layout(spec, start)
        rows = [state[f"{k}_per_rank"] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")]
        model_state = float(max(sum(col) for col in zip(*rows, strict=True)))
    except (KeyError, TypeError, ValueError) as err:
        raise _bad(path, f"its run_start or model_state event lacks a field ({err})") from None
    timed = [e for e in steps if e.get("step", 0) >= 2] or steps
    device = str(start.get("device", "cpu"))
    per_rank, increment = _peak(device, steps, memory)
    batch = batch_of(spec)
    return RunRecord(path=path, spec=spec, world=int(start["world_size"]), device=device,
                     layout=layout, batch=batch,
                     step_time_s=statistics.median(float(e["step_time_s"]) for e in timed),
                     steps_timed=len(timed), model_state_bytes=model_state,
                     peak_bytes=max(per_rank) if per_rank else None,
                     peak_is_increment=increment, peak_bytes_per_rank=per_rank)


def _layout(spec: RunSpec, start: dict[str, Any]) -> Layout:
    """The planner's Layout of what ran: degrees and ZeRO stage as resolved at launch (run_start),
    the rest from the spec."""
    return layout_of(spec, dict(start["mesh"]), int(start["zero"]))


def _peak(device: str, steps: list[dict[str, Any]],
          memory: dict[str, Any] | None) -> tuple[tuple[float, ...], bool]:
    """(the peak of each rank, or on CUDA the largest step peak alone; whether each is an
    increment over the RSS before the model)."""
    if device != "cpu":
        peaks = [float(e["peak_mem_bytes"]) for e in steps
                 if isinstance(e.get("peak_mem_bytes"), int | float)]
        return ((max(peaks),) if peaks else ()), True
    last = next((e for e in reversed(steps) if e.get("peak_mem_bytes_per_rank")), None)
    if last is None:
        return (), True
    peaks = [float(v) for v in last["peak_mem_bytes_per_rank"]]
    base = (memory or {}).get("rss_before_model_bytes_per_rank")
    if not base or len(base) != len(peaks):
        return tuple(peaks), False
    return tuple(p - float(b) for p, b in zip(peaks, base, strict=True)), True


# --- predicting ------------------------------------------------------------------------------

def cluster_for(cluster: ClusterSpec, world: int,
                cpu_local: Callable[[int], ClusterSpec] | None = None) -> ClusterSpec:
    """`cluster` resized to a run's world: `cpu-local` rebuilt for that many workers (they share
    the cores); another cluster with world / devices_per_node nodes, or one node of `world`
    devices when that does not divide."""
    if cluster.world == world:
        return cluster
    if cluster.name == "cpu-local" and cpu_local is not None:
        return cpu_local(world)
    if world % cluster.devices_per_node == 0:
        return cluster.with_nodes(world // cluster.devices_per_node)
    return dataclasses.replace(cluster, cluster=dataclasses.replace(
        cluster.cluster, nodes=1, devices_per_node=world))


def evaluate(run: RunRecord, model: ModelDims, cluster: ClusterSpec,
             params: CostParams) -> RunError:
    pred = predict(run.layout, model, cluster, run.batch, params)
    mem = pred.memory
    if run.peak_bytes is None:
        peak = None
    elif run.device == "cpu":
        peak = mem.total - (mem.overhead if run.peak_is_increment else 0.0)
    else:
        peak = mem.total - mem.overhead - mem.fragmentation
    return RunError(run=run, prediction=pred, model_state_pred=mem.model_state, peak_pred=peak,
                    step_time_pred=pred.step_time_s)



def mean_abs(errors: Sequence[float | None]) -> float | None:
    vals = [abs(e) for e in errors if e is not None and math.isfinite(e)]
    return sum(vals) / len(vals) if vals else None

