"""What runs between steps: an ordered, appendable list of hooks, and the three built-in ones.

A hook is `fn(result)` plus when it is due (levanter's `add_hook(fn, every=)` is the model): every
`every`-th step, optionally at the last step and at the step a preemption stops at. A hook gets
what it reads when it is made — the built-in ones below are small objects holding their
dependencies — so the trainer's loop knows nothing of what a hook does, and a user of
`Trainer.add_hook` extends the run without subclassing anything. Hooks run on every rank, in order;
one that calls a collective must be due on every rank alike (every built-in one is).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint import Checkpointer, SaveRecord
from shardwise.data import BatchLayout, EvalBatches, TrainBatches
from shardwise.meta import __version__
from shardwise.parallel.distributed import DistContext
from shardwise.resilience.faults import FaultInjector
from shardwise.run import manifest
from shardwise.run.loss_scale import LossScaler
from shardwise.run.monitors import Monitors
from shardwise.run.record import TrainSummary
from shardwise.run.step import StepResult, evaluate
from shardwise.telemetry import EventLog, syncs
from shardwise.telemetry.experts import merge_rows, summary_row
from shardwise.telemetry.perf import Gather, RunPerf


@dataclass
class Hook:
    """`fn(result)` after every `every`-th step (0 = never), at the last step if `at_end`, and at
    the step a preemption stops at if `on_stop`. `phase` is what the monitors call the time it
    takes; `pauses_watchdog` for a hook that runs long without collectives (a checkpoint write)."""

    fn: Callable[[StepResult], None]
    every: int
    name: str = ""
    at_end: bool = True
    on_stop: bool = False
    phase: str = "hook"
    pauses_watchdog: bool = False

    def due(self, step: int, last: bool, stopping: bool = False) -> bool:
        return ((self.every > 0 and step % self.every == 0) or (self.at_end and last)
                or (self.on_stop and stopping))


class Hooks:
    """The run's hooks, run in the order they were added."""

    def __init__(self) -> None:
        self._hooks: list[Hook] = []

    def add(self, fn: Callable[[StepResult], None], every: int, *, name: str = "",
            at_end: bool = True, on_stop: bool = False, phase: str = "hook",
            pauses_watchdog: bool = False) -> Hook:
        hook = Hook(fn, every, name or getattr(fn, "__name__", type(fn).__name__), at_end,
                    on_stop, phase, pauses_watchdog)
        self._hooks.append(hook)
        return hook

    def __iter__(self) -> Iterator[Hook]:
        return iter(list(self._hooks))

    def __len__(self) -> int:
        return len(self._hooks)


@dataclass
class StepTimes:
    """Per step of this launch: wall seconds (the monitors' step time) and host syncs (GPU, with
    SHARDWISE_SYNC_DEBUG=1)."""

    seconds: list[float] = field(default_factory=list)
    host_syncs: list[int] = field(default_factory=list)


@dataclass
class LogHook:
    """The `step` event: loss, throughput, the monitors' window, MFU and memory, ETA (collective:
    the window's figures are gathered from every rank)."""

    every: int
    stop_step: int
    events: EventLog
    monitors: Monitors
    gather: Gather
    ctx: DistContext
    layout: BatchLayout
    times: StepTimes
    perf: Callable[[], RunPerf]
    model_state: Callable[[], dict[str, int] | None]
    tokens_seen: Callable[[], int]
    scaler: LossScaler | None = None
    experts: bool = False  # the model routes tokens to experts (the plan says so on every rank)

    def __call__(self, result: StepResult) -> None:
        recent = self.times.seconds[-self.every:]
        window = self.monitors.window_fields(result.step, self.gather)  # collective
        step_time = window["step_time_s"]
        extra: dict[str, Any] = {}
        if syncs.enabled(self.ctx.device):
            extra["host_syncs_per_step"] = statistics.median(self.times.host_syncs[-self.every:])
        if self.scaler is not None:
            extra = {"loss_scale": result.loss_scale, "skipped_steps": self.scaler.skipped_steps}
        dp, batch = self.ctx.dims.dp, self.layout.global_batch
        self.events.emit(
            "step", result.step, **extra, loss=result.loss, lr=result.lr,
            grad_norm=result.grad_norm, tokens_per_s=result.tokens / step_time,
            samples_per_s=batch / step_time, **window,
            # each data-parallel replica's share of the tokens over that rank's own step time
            tokens_per_s_per_rank=[round(result.tokens / dp / t, 1)
                                   for t in window["step_time_s_per_rank"]],
            samples_per_s_per_rank=[round(batch / dp / t, 3)
                                    for t in window["step_time_s_per_rank"]],
            **self.perf().on_log(result.step, result.tokens, step_time, self.model_state()),
            tokens_seen=self.tokens_seen(),
            eta_s=(self.stop_step - result.step) * statistics.mean(recent),
            straggler=self.monitors.current_straggler or None, **self._expert_fields(result))

    def _expert_fields(self, result: StepResult) -> dict[str, float]:
        """The step's MoE routing figures (telemetry/experts.py); collective when the model has
        experts, nothing otherwise."""
        if not self.experts:
            return {}
        dims = self.ctx.dims  # every rank of a stage holds the step's global figures
        return merge_rows(self.gather(summary_row(result.experts)), dims.dp * dims.cp * dims.tp)


@dataclass
class EvalHook:
    """The `eval` event: the held-out loss (and accuracy where outputs score classes)."""

    model: Any  # the ParallelModel
    data: EvalBatches
    summary: TrainSummary
    events: EventLog
    unigram_loss: float
    baseline: str

    def __call__(self, result: StepResult) -> None:
        held_out = evaluate(self.model, self.data)
        self.summary.val_losses[result.step] = held_out.loss
        self.summary.val_times[result.step] = time.time()  # the run's time to target
        if held_out.accuracy is not None:
            self.summary.val_accuracies[result.step] = held_out.accuracy
        self.events.emit("eval", result.step, val_loss=held_out.loss,
                         val_accuracy=held_out.accuracy, unigram_loss=self.unigram_loss,
                         baseline=self.baseline, eval_tokens=held_out.targets)


@dataclass
class CheckpointHook:
    """A checkpoint of every component, with what a resume at another layout checks (collective;
    async saves commit in the background and report at the next save or the end of the run)."""

    checkpointer: Checkpointer
    components: Callable[[], dict[str, Any]]
    train_data: TrainBatches
    ctx: DistContext
    spec_digest: str
    run_dir: Path
    faults: FaultInjector
    events: EventLog
    summary: TrainSummary

    def __call__(self, result: StepResult) -> None:
        dims = self.ctx.dims
        meta = {"layout": dims.describe(), "world_size": self.ctx.world_size,
                "mesh": dims.mesh_shape, "spec_digest": self.spec_digest,
                "shardwise_version": __version__, "torch_version": torch.__version__,
                "consumed_samples": self.train_data.consumed_samples}

        def committed(record: SaveRecord) -> None:  # async: at the next save or end of fit
            self.faults.after_checkpoint(record.step, record.path)
            self.events.emit("checkpoint", record.step, **record.event_fields())

        # the checkpoint-write fault fires once this rank's files are written and nothing is
        # committed (async: in the background, while the step loop has moved on)
        path = self.checkpointer.save(
            result.step, self.components(), meta, attach=(self.run_dir / manifest.MANIFEST,),
            on_written=lambda: self.faults.at("checkpoint-write", result.step),
            on_committed=committed)
        self.summary.checkpoint = str(path)


HOOK_EXAMPLE = "py:my_hooks.py:setup"


def user_hook_setups(entries: tuple[str, ...]) -> list[Callable[[Any], None]]:
    """The `run.hooks` functions, loaded (a missing file or function is a UserError naming it):
    the launcher calls this before any worker starts, each worker again to call them."""
    from shardwise.utils.pyfile import load_function

    return [load_function(entry, "run.hooks", HOOK_EXAMPLE, "setup(trainer)") for entry in entries]
