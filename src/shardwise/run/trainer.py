"""Train a run: a short loop of steps plus hooks.

The trainer owns only `{step, tokens_seen}`; model, optimizer and data cursor own their state, and
the checkpointer saves them as a set. The pieces are built by `run.assembly`, what happens between
steps is a hook (`run.hooks`), where a launch starts and how it rolls back is `run.recovery`, and
what it records about itself is `run.record`: the loop below only orders them.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import ModelState
from shardwise.checkpoint.location import Location
from shardwise.compat import TorchPatches
from shardwise.data import PreparedData
from shardwise.parallel.distributed import DistContext
from shardwise.resilience.preempt import SignalFlag, clear_marker
from shardwise.run.assembly import PerfOnce, assemble
from shardwise.run.hooks import CheckpointHook, EvalHook, Hook, Hooks, LogHook, StepTimes
from shardwise.run.record import RunRecord, TrainSummary
from shardwise.run.recovery import NumericsGuard, Recovery
from shardwise.run.resume import ResumeMode
from shardwise.run.rundir import run_id
from shardwise.run.schedule import lr_at
from shardwise.run.step import StepLog, StepResult, train_step
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog, syncs

__all__ = ["Hook", "TrainState", "TrainSummary", "Trainer"]


@dataclass
class TrainState:
    """The trainer's own resume state."""

    step: int = 0
    # targets trained on; a device tensor while it includes steps that counted their own targets
    # (samples with padding), read at log steps and in checkpoints only
    tokens_seen: int | torch.Tensor = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": int(self.tokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


class Trainer:
    def __init__(self, spec: RunSpec, ctx: DistContext, run_dir: Path, data: PreparedData,
                 events: EventLog, patches: TorchPatches | None = None,
                 flag: SignalFlag | None = None,
                 model_source: dict[str, Any] | None = None) -> None:
        """`patches`: the worker's runtime (`shardwise.run.worker`), through which the meta build
        and the comm tap change torch; without one each keeps a scope of its own. `flag`: the
        preemption handlers the worker installed first thing (and what they caught);
        `model_source`: what pins the model's code, computed at start-up (`run.worker`). The
        pieces are built by `run.assembly`; the trainer keeps its own state and the loop."""
        self.spec, self.ctx, self.run_dir, self.data, self.events = spec, ctx, run_dir, data, events
        parts = assemble(spec, ctx, run_dir, data, events, patches, flag)
        self.layout, self.model, self.num_params = parts.layout, parts.model, parts.num_params
        self.optimizers, self.scaler, self.meter = parts.optimizers, parts.scaler, parts.meter
        self.faults, self.monitors, self.gather = parts.faults, parts.monitors, parts.gather
        self.train_data, self.eval_data = parts.train_data, parts.eval_data
        self.checkpointer, self.preemption = parts.checkpointer, parts.preemption
        self.ledger, self.rss_before_model = parts.ledger, parts.rss_before_model
        self.model.phase_hook = lambda phase: self.on_phase(phase, self.state.step + 1)
        self.baseline = "class prior" if data.samples is not None else "unigram"
        self.state = TrainState()
        self.summary = TrainSummary(unigram_loss=data.unigram_val_loss,
                                    model_params=self.num_params)
        self.times = StepTimes()
        self.steplog = StepLog(self.model)
        self.perf = PerfOnce(spec, ctx, parts, events)  # a collective at its first call
        self._start_step = 0
        self._state_logged = False
        self.recovery = Recovery(self.checkpointer, self.components, lambda: self.state.step,
                                 events, ctx.is_main, run_dir=run_dir)
        self.guard = NumericsGuard(spec.failure.nan_patience, self.recovery, self.train_data,
                                   self.ledger, ctx, self.layout, events, self.scaler is not None,
                                   spec.failure.max_rollbacks, self.monitors.paused)
        self.record = RunRecord(spec, ctx, run_dir, data, events, self.model, self.perf,
                                self.layout, self.train_data, self.num_params, self.baseline,
                                source=model_source)
        self.hooks = Hooks()
        self._add_builtin_hooks()

    def _add_builtin_hooks(self) -> None:
        spec = self.spec
        self.log_hook = self.hooks.add(
            LogHook(spec.log.every, self.stop_step, self.events, self.monitors, self.gather,
                    self.ctx, self.layout, self.times, self.perf,
                    lambda: self.meter.report, lambda: int(self.state.tokens_seen), self.scaler,
                    experts=bool(self.model.plan.experts)),
            spec.log.every, name="log", on_stop=True)
        self.hooks.add(EvalHook(self.model, self.eval_data, self.summary, self.events,
                                self.data.unigram_val_loss, self.baseline),
                       spec.eval.every, name="eval")
        if spec.checkpoint.enabled:  # false: never saves, not even at a preemption
            self.hooks.add(CheckpointHook(self.checkpointer, self.components, self.train_data,
                                          self.ctx, spec.digest(), self.run_dir, self.faults,
                                          self.events, self.summary),
                           spec.checkpoint.every, name="checkpoint", at_end=True, on_stop=True,
                           phase="checkpoint", pauses_watchdog=True)

    def add_hook(self, fn: Callable[[StepResult], None], every: int, **when: Any) -> Hook:
        """Run `fn(result)` after every `every`-th step, after the built-in hooks (log, eval,
        checkpoint); `when`: `at_end`, `on_stop`, `name` (see `run.hooks.Hook`). On every rank:
        a hook that calls a collective must be added on every rank alike."""
        return self.hooks.add(fn, every, **when)

    # --- state -------------------------------------------------------------------------------
    def components(self) -> dict[str, Any]:
        components = {"model": ModelState(self.model.parts), "optim": self.optimizers,
                      "train": self.state, "data": self.train_data}
        if self.scaler is not None:
            components["loss_scale"] = self.scaler
        return components

    def start(self, mode: ResumeMode) -> None:
        """Make the checkpoint location this run's for this launch (`Checkpointer.claim`), then
        act on the resume rule (`run.resume`, see `Recovery.start`)."""
        if self.spec.checkpoint.enabled:
            self.checkpointer.claim(run_id(self.run_dir), self.run_dir, mode is ResumeMode.FRESH,
                                    wait_s=self.spec.parallel.timeout_s / 2)
        if self.recovery.start(mode, self.run_dir, self.spec) and self.ctx.is_main:
            print(f"note: {self.run_dir} is already at step {self.state.step}, its last: "
                  "nothing left to train", file=sys.stderr)

    def resume(self, checkpoint: Location) -> None:
        self.recovery.load(checkpoint)

    @property
    def stop_step(self) -> int:
        return self.spec.run.stop_at or self.spec.run.steps

    # --- the loop ----------------------------------------------------------------------------
    def on_phase(self, phase: str, step: int) -> None:
        """`step` (1-based) enters `phase`: the monitors mark it, then any planted fault fires."""
        self.monitors.phase(phase, step)
        self.faults.at(phase, step)

    def steps(self) -> Iterator[StepResult]:
        spec = self.spec
        while self.state.step < self.stop_step:
            self.monitors.begin_step(self.state.step + 1)
            self.ledger.record(self.state.step + 1, self.train_data.step_indices())
            self.faults.at("data", self.state.step + 1)
            batches, tokens = self.train_data.next_step()
            with self.meter.measuring(first=self.state.step == self._start_step), \
                    syncs.counting(self.ctx.device) as synced:
                result = train_step(
                    self.model, self.optimizers, batches, tokens, step=self.state.step,
                    lr=lr_at(self.state.step, spec.optimizer, spec.run.steps),
                    grad_clip=spec.optimizer.grad_clip, scaler=self.scaler, faults=self.faults,
                    on_phase=self.on_phase)
            self.state.step = result.step
            self.state.tokens_seen += result.tokens  # (the step's count, if the data had none)
            self.times.host_syncs.append(synced[0])
            self.times.seconds.append(self.monitors.end_step(result.step))
            yield result

    def fit(self) -> TrainSummary:
        self._start_step = self.state.step
        self.record.write_manifest(self.recovery.lineage)
        self.ledger.count_launches()
        if self.ctx.distributed:  # every rank has read the launch count before rank 0 appends
            dist.barrier()
        self.ledger.start_launch(self.state.step, self.ctx.world_size, self.ctx.dims.dp,
                                 self.layout.global_batch, branch=self.recovery.branch)
        self.record.emit_start(self.state.step)
        t_start = time.perf_counter()
        self.monitors.start()
        if self.ctx.is_main:
            clear_marker(self.run_dir)  # the marker a launcher reads is this launch's
        # The preemption handlers stay installed until the last save has committed: a signal
        # while it is written (Slurm's --signal=USR1@grace, as a job sized to its time limit
        # ends) is recorded, not fatal, and the save completes.
        failed = True
        try:
            self._loop()
            failed = False
        finally:
            try:
                self.checkpointer.close(self.monitors.paused)  # a save in flight commits first
            finally:
                self.preemption.close(wait=not failed)  # after a failure a peer may be gone
                self.monitors.close()
        self.summary.final_step = self.state.step
        self.ledger.close()
        self.record.finish(self.state.step, time.perf_counter() - t_start,
                           int(self.state.tokens_seen), self.summary, self.monitors.goodput(),
                           self.preemption)
        return self.summary

    def _loop(self) -> None:
        for result in self.steps():
            last = result.step == self.stop_step
            # collective, at every step boundary: stop if a signal reached any rank
            stopping = self.preemption.poll() and not last
            result = self._resolve_if_read(result, last or stopping)
            if self.guard.check(result):
                continue  # rolled back: the loop goes on from the checkpoint's step
            if self.meter.report is not None and not self._state_logged:
                self._state_logged = True
                self.record.emit_model_state(result.step, self.meter.report, self.gather)
            if result.step == self._start_step + 1 and self.faults.attempt > 0:
                self.record.emit_restart(result.step, self.faults.attempt, self._start_step,
                                         self.monitors.previous_attempt_step())
            for hook in self.hooks:
                if hook.due(result.step, last, stopping):
                    self.monitors.phase(hook.phase, result.step)
                    with self.monitors.paused() if hook.pauses_watchdog \
                            else contextlib.nullcontext():
                        hook.fn(result)
            if stopping:
                self.summary.preempted = {"step": result.step,
                                          "signal": self.preemption.signal_name,
                                          "checkpoint": self.summary.checkpoint}
                return

    def _resolve_if_read(self, result: StepResult, last: bool) -> StepResult:
        """Keep the step's loss and norm on the device unless something reads them now: a log
        step, the last step, or a skipped (non-finite) step, which every rank knows alike.
        Resolving reads every pending step at once (collective) into the summary."""
        self.steplog.add(result)
        if not (last or result.skipped or self.log_hook.due(result.step, last)):
            return result
        resolved = self.steplog.resolve()
        self.summary.losses.extend(r.loss for r in resolved)
        self.summary.grad_norms.extend(r.grad_norm for r in resolved)
        return resolved[-1]
