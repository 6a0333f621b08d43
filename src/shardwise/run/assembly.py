"""Build the pieces of one training launch from its spec, in the order they depend on each other:
kernels and seed, the batch layout, the model (meta build, layout check, parallelize, pretrained
weights), optimizers and loss scaler, fault injection and monitors, the data cursors, the
checkpointer and the preemption group, the sample ledger.

Kept apart from `run.trainer` so that the trainer is the loop alone: it receives these pieces and
orders them per step; what each piece is and how it is made is decided here once.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.checkpoint import Checkpointer
from shardwise.compat import TorchPatches
from shardwise.data import BatchLayout, EvalBatches, PreparedData, TrainBatches
from shardwise.data.ledger import LedgerWriter
from shardwise.models import build_deferred
from shardwise.models.plan import plan_of
from shardwise.parallel.accounting import ModelStateMeter
from shardwise.parallel.checks import check_layout
from shardwise.parallel.devices import resolve_backend
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.execution import ParallelModel
from shardwise.parallel.parallelize import parallelize
from shardwise.parallel.precision import configure_kernels
from shardwise.parallel.support import check_torch_supports
from shardwise.resilience.faults import FaultInjector
from shardwise.resilience.preempt import Preemption, SignalFlag
from shardwise.run.loss_scale import LossScaler
from shardwise.run.monitors import Gather, Monitors, gather_rows
from shardwise.run.optim import Optimizers
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog
from shardwise.telemetry.comm_theory import min_wire_bytes
from shardwise.telemetry.memory import current_rss_bytes
from shardwise.telemetry.perf import PerfInputs, RunPerf


@dataclass
class RunParts:
    """What one launch trains with; each piece owns its own state."""

    layout: BatchLayout
    model: ParallelModel
    num_params: int
    rss_before_model: int | None  # host memory before the model existed (a CPU run's baseline)
    optimizers: Optimizers
    scaler: LossScaler | None
    meter: ModelStateMeter
    faults: FaultInjector
    monitors: Monitors
    train_data: TrainBatches
    eval_data: EvalBatches
    checkpointer: Checkpointer
    preemption: Preemption
    ledger: LedgerWriter
    gather: Gather


def assemble(spec: RunSpec, ctx: DistContext, run_dir: Path, data: PreparedData,
             events: EventLog, patches: TorchPatches | None,
             flag: SignalFlag | None) -> RunParts:
    """Every piece of the launch, on every rank alike (several steps are collectives)."""
    check_torch_supports(spec.parallel, resolve_backend(spec.parallel, ctx.device.type))
    torch.manual_seed(spec.run.seed)
    configure_kernels(spec.run.determinism, spec.run.tf32, ctx.device)
    if spec.run.determinism == "invariant":
        torch.set_num_threads(1)  # the bits of a matmul depend on the thread count
    layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, ctx.dims.dp)
    rss_before_model = current_rss_bytes() if ctx.device.type == "cpu" else None
    model, num_params = build_model(spec, ctx, data.vocab_size, layout, patches, events)
    optimizers = Optimizers(model, spec.optimizer, spec.parallel.bucket_mb)
    faults = FaultInjector.from_spec(spec.failure.faults, ctx.rank)
    faults.group, faults.device = ctx.dp_group(), ctx.device
    monitors = Monitors(spec, ctx, run_dir, events, faults.attempt, patches)
    monitors.min_wire_bytes = min_wire_bytes(
        ctx.dims, spec.run.precision, num_params, layout.accumulation,
        spec.batch.micro_batch * spec.data.seq_len, model.plan.shape.layers,
        model.plan.shape.hidden)
    checkpointer = Checkpointer.for_run(run_dir / "checkpoints", spec.checkpoint, ctx.rank,
                                        ctx.distributed, spec.parallel.timeout_s,
                                        device=ctx.device)
    return RunParts(
        layout=layout, model=model, num_params=num_params, rss_before_model=rss_before_model,
        optimizers=optimizers,
        scaler=LossScaler(spec.loss_scale) if spec.run.precision == "fp16" else None,
        meter=ModelStateMeter(model, optimizers), faults=faults, monitors=monitors,
        train_data=TrainBatches(data.split("train", spec.data.seq_len), spec.run.seed, layout,
                                ctx.dp_rank, ctx.device),
        eval_data=EvalBatches(data.split("val", spec.data.seq_len), layout, spec.eval.batches,
                              ctx.dp_rank, ctx.device),
        checkpointer=checkpointer,
        # collective (a gloo group of its own), after the checkpointer's, on every rank alike
        preemption=Preemption.start(spec.failure.preempt_signals, ctx.distributed,
                                    spec.parallel.timeout_s, flag),
        ledger=LedgerWriter(run_dir, ctx.rank, ctx.dp_rank, writes=ctx.leads_replica),
        gather=gather_rows(ctx))


def build_model(spec: RunSpec, ctx: DistContext, vocab_size: int, layout: BatchLayout,
                patches: TorchPatches | None, events: EventLog) -> tuple[ParallelModel, int]:
    """The model on the meta device, checked against the layout and parallelized: each rank
    materialises only its shards; then pretrained weights, if any. Returns it with its
    parameter count."""
    model, init = build_deferred(spec.model, vocab_size, spec.data.seq_len, spec.run.seed,
                                 patches)
    if init.fallback and ctx.is_main:
        print(f"note: model.init = \"meta\" fell back to the eager build ({init.fallback}); "
              "every rank holds the whole model in host memory at start-up", file=sys.stderr)
    plan = plan_of(model)
    check_layout(spec, ctx.dims, plan, layout.accumulation)
    parallel = parallelize(model, ctx, spec.parallel, spec.memory, spec.run, layout.accumulation,
                           record=init)
    del model, init  # the record (RNG states, constants) is not needed after materialising
    _load_pretrained(spec, ctx, parallel, events)  # before the optimizers copy anything
    return parallel, plan.shape.params


def _load_pretrained(spec: RunSpec, ctx: DistContext, model: ParallelModel,
                     events: EventLog) -> None:
    """Pretrained weights (`model.hf_path`): each rank reads its own shards of them. A resume
    then overwrites them with the checkpoint's."""
    hf = spec.model.hf
    if hf is None or not hf.hf_path:
        return
    from shardwise.checkpoint.hf import load_pretrained

    t0 = time.perf_counter()
    root = Path(hf.hf_path).expanduser()
    count = load_pretrained(model.parts, hf, root, ctx.distributed)
    events.emit("pretrained", 0, path=str(root.resolve()), tensors=count,
                load_s=round(time.perf_counter() - t0, 4))



class PerfOnce:
    """The run's FLOPs/MFU, memory and bubble figures (`RunPerf`), built at first call: that is a
    collective (the ranks agree on the peak FLOP/s), made at the start of `fit` on every rank."""

    def __init__(self, spec: RunSpec, ctx: DistContext, parts: RunParts,
                 events: EventLog) -> None:
        self.spec, self.ctx, self.parts, self.events = spec, ctx, parts, events
        self._perf: RunPerf | None = None

    def __call__(self) -> RunPerf:
        if self._perf is None:
            spec, parts = self.spec, self.parts
            inputs = PerfInputs(spec.memory, spec.parallel, spec.run.precision,
                                spec.telemetry.peak_flops, spec.data.cache_dir)
            self._perf = RunPerf(inputs, self.ctx, parts.model, parts.optimizers.optimizers,
                                 parts.layout.accumulation, parts.gather, self.events,
                                 parts.rss_before_model)
        return self._perf
