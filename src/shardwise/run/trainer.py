"""Build a run from a RunSpec and train it: a short loop of steps plus hooks.

The trainer owns only `{step, tokens_seen}`; model, optimizer and data cursor own their state, and
the checkpointer saves them as a set. What happens between steps is a hook (`run.hooks`), where a
launch starts and how it rolls back is `run.recovery`, and what it records about itself is
`run.record`: the loop below only orders them.
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

from shardwise.checkpoint import Checkpointer, ModelState
from shardwise.checkpoint.location import Location
from shardwise.compat import TorchPatches
from shardwise.data import BatchLayout, EvalBatches, PreparedData, TrainBatches
from shardwise.data.ledger import LedgerWriter
from shardwise.meta import STARTED_AT
from shardwise.models import build_deferred
from shardwise.models.plan import plan_of
from shardwise.parallel.accounting import ModelStateMeter
from shardwise.parallel.checks import check_layout
from shardwise.parallel.devices import resolve_backend
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.precision import configure_kernels
from shardwise.parallel.support import check_torch_supports
from shardwise.resilience.faults import FaultInjector
from shardwise.resilience.preempt import Preemption, SignalFlag, clear_marker
from shardwise.run.hooks import CheckpointHook, EvalHook, Hook, Hooks, LogHook, StepTimes
from shardwise.run.loss_scale import LossScaler
from shardwise.run.monitors import Monitors, gather_rows
from shardwise.run.optim import Optimizers
from shardwise.run.record import RunRecord, TrainSummary
from shardwise.run.recovery import NumericsGuard, Recovery
from shardwise.run.resume import ResumeMode
from shardwise.run.rundir import run_id
from shardwise.run.schedule import lr_at
from shardwise.run.step import StepLog, StepResult, train_step
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog, syncs
from shardwise.telemetry.comm_theory import min_wire_bytes
from shardwise.telemetry.memory import current_rss_bytes
from shardwise.telemetry.perf import PerfInputs, RunPerf

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
        `model_source`: what pins the model's code, computed at start-up (`run.worker`)."""
        self.spec, self.ctx, self.run_dir, self.data, self.events = spec, ctx, run_dir, data, events
        check_torch_supports(spec.parallel, resolve_backend(spec.parallel, ctx.device.type))
        torch.manual_seed(spec.run.seed)
        configure_kernels(spec.run.determinism, spec.run.tf32, ctx.device)
        if spec.run.determinism == "invariant":
            torch.set_num_threads(1)  # the bits of a matmul depend on the thread count
        self.layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch,
                                          ctx.dims.dp)
        # host memory before the model exists: the baseline of a CPU run's peak (memory event)
        self.rss_before_model = current_rss_bytes() if ctx.device.type == "cpu" else None
        self._build_model(patches)
        self.optimizers = Optimizers(self.model, spec.optimizer)
        self.scaler = LossScaler(spec.loss_scale) if spec.run.precision == "fp16" else None
        self.meter = ModelStateMeter(self.model, self.optimizers)
        self.faults = FaultInjector.from_spec(spec.failure.faults, ctx.rank)
        self.faults.group = ctx.dp_group()
        self.faults.device = ctx.device
        self.monitors = Monitors(spec, ctx, run_dir, events, self.faults.attempt, patches)
        self.monitors.min_wire_bytes = min_wire_bytes(
            ctx.dims, spec.run.precision, self.num_params, self.layout.accumulation,
            spec.batch.micro_batch * spec.data.seq_len, self.model.plan.shape.layers,
            self.model.plan.shape.hidden)
        self.model.phase_hook = lambda phase: self.on_phase(phase, self.state.step + 1)
        self.train_data = TrainBatches(data.split("train", spec.data.seq_len), spec.run.seed,
                                       self.layout, ctx.dp_rank, ctx.device)
        self.eval_data = EvalBatches(data.split("val", spec.data.seq_len), self.layout,
                                     spec.eval.batches, ctx.dp_rank, ctx.device)
        self.baseline = "class prior" if data.samples is not None else "unigram"
        self.state = TrainState()
        self.checkpointer = Checkpointer.for_run(run_dir / "checkpoints", spec.checkpoint, ctx.rank,
                                                 ctx.distributed, spec.parallel.timeout_s,
                                                 device=ctx.device)
        # collective (a gloo group of its own), after the checkpointer's, on every rank alike
        self.preemption = Preemption.start(spec.failure.preempt_signals, ctx.distributed,
                                           spec.parallel.timeout_s, flag)
        self.summary = TrainSummary(unigram_loss=data.unigram_val_loss,
                                    model_params=self.num_params)
        self.times = StepTimes()
        self.steplog = StepLog(self.model)
        self.gather = gather_rows(ctx)
        self._perf: RunPerf | None = None
        self._start_step = 0
        self._state_logged = False
        self.ledger = LedgerWriter(run_dir, ctx.rank, ctx.dp_rank, writes=ctx.leads_replica)
        self.recovery = Recovery(self.checkpointer, self.components, lambda: self.state.step,
                                 events, ctx.is_main, run_dir=run_dir)
        self.guard = NumericsGuard(spec.failure.nan_patience, self.recovery, self.train_data,
                                   self.ledger, ctx, self.layout, events, self.scaler is not None,
                                   spec.failure.max_rollbacks, self.monitors.paused)
        self.record = RunRecord(spec, ctx, run_dir, data, events, self.model, lambda: self.perf,
                                self.layout, self.train_data, self.num_params, self.baseline,
                                source=model_source)
        self.hooks = Hooks()
        self._add_builtin_hooks()

    def _build_model(self, patches: TorchPatches | None) -> None:
        """The model on the meta device, checked against the layout and parallelized: each rank
        materialises only its shards; then pretrained weights, if any."""
        spec, ctx = self.spec, self.ctx
        model, init = build_deferred(spec.model, self.data.vocab_size, spec.data.seq_len,
                                     spec.run.seed, patches)
        if init.fallback and ctx.is_main:
            print(f"note: model.init = \"meta\" fell back to the eager build ({init.fallback}); "
                  "every rank holds the whole model in host memory at start-up",
                  file=sys.stderr)
        plan = plan_of(model)
        check_layout(spec, ctx.dims, plan, self.layout.accumulation)
        self.num_params = plan.shape.params
        self.model = parallelize(model, ctx, spec.parallel, spec.memory, spec.run,
                                 self.layout.accumulation, record=init)
        del model, init  # the record (RNG states, constants) is not needed after materialising
        self._load_pretrained()  # before the optimizers copy anything (ZeRO-1 master shards)

    def _add_builtin_hooks(self) -> None:
        spec = self.spec
        self.log_hook = self.hooks.add(
            LogHook(spec.log.every, self.stop_step, self.events, self.monitors, self.gather,
                    self.ctx, self.layout, self.times, lambda: self.perf,
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

    def _load_pretrained(self) -> None:
        """Pretrained weights (`model.hf_path`): each rank reads its own shards of them. A
        resume then overwrites them with the checkpoint's."""
        hf = self.spec.model.hf
        if hf is None or not hf.hf_path:
            return
        from shardwise.checkpoint.hf import load_pretrained

        t0 = time.perf_counter()
        root = Path(hf.hf_path).expanduser()
        count = load_pretrained(self.model.parts, hf, root, self.ctx.distributed)
        self.events.emit("pretrained", 0, path=str(root.resolve()), tensors=count,
                         load_s=round(time.perf_counter() - t0, 4))

    @property
    def perf(self) -> RunPerf:
        """FLOPs/MFU, memory and bubble figures; built at first use (a collective: the ranks
        agree on the peak FLOP/s), which is the start of `fit` on every rank."""
        if self._perf is None:
            spec = self.spec
            inputs = PerfInputs(spec.memory, spec.parallel, spec.run.precision,
                                spec.telemetry.peak_flops, spec.data.cache_dir)
            self._perf = RunPerf(inputs, self.ctx, self.model, self.optimizers.optimizers,
                                 self.layout.accumulation, self.gather, self.events,
                                 self.rss_before_model)
        return self._perf

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
        if self.summary.preempted is not None:
            self.record.end_preempted(self.state.step, self.summary.preempted, self.preemption)
            return self.summary
        if self.state.step == self.spec.run.steps and self.spec.sample.tokens:
            self.summary.sample_text = self.record.sample(
                self.state.step, self.spec.sample, self.spec.data.seq_len, self.spec.run.seed)
        self.record.emit_end(self.state.step, time.perf_counter() - t_start,
                             int(self.state.tokens_seen), self.summary, self.monitors.goodput())
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
                self.events.emit("model_state", result.step, **self._gathered_state())
            if result.step == self._start_step + 1 and self.faults.attempt > 0:
                self._emit_restart(result.step)
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

    def _emit_restart(self, step: int) -> None:
        reached = self.monitors.previous_attempt_step()
        self.events.emit("restart", step, attempt=self.faults.attempt,
                         resumed_from_step=self._start_step,
                         seconds_to_first_step=round(time.time() - STARTED_AT, 3),
                         failed_at_step=reached,
                         steps_lost=None if reached is None else max(0, reached - self._start_step))

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

    def _gathered_state(self) -> dict[str, Any]:
        """Per-rank model-state bytes, each a list in rank order (collective)."""
        keys = list(self.meter.report)
        rows = self.gather([float(self.meter.report[k]) for k in keys])  # one all-gather
        return {f"{key}_per_rank": [int(row[i]) for row in rows] for i, key in enumerate(keys)}
