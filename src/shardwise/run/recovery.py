"""Where a launch starts and how it backs out: the resume rule with its messages, loading a
checkpoint (the `resume` event and the lineage it continues), and the numerics guard's rollback.

`Recovery.start` acts on `run.resume` (collective: ranks hash their share of the checkpoint's
files in parallel); `NumericsGuard.check` counts consecutive non-finite steps and, after
`failure.nan_patience` of them, rolls back to the newest valid checkpoint and skips the batches
that diverged, so they are never trained on.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shardwise.checkpoint import Checkpointer
from shardwise.checkpoint.location import Location
from shardwise.data import BatchLayout, TrainBatches
from shardwise.data.ledger import LedgerWriter
from shardwise.errors import UserError
from shardwise.parallel.distributed import DistContext
from shardwise.run import manifest, rundir
from shardwise.run.branch import marked as branch_marked
from shardwise.run.resume import ResumeMode, check_compatible, complete
from shardwise.run.step import StepResult
from shardwise.spec.runspec import RunSpec
from shardwise.telemetry import EventLog
from shardwise.utils.files import atomic_write_text


@dataclass
class Recovery:
    """Loads checkpoints into the run's components and says which and why."""

    checkpointer: Checkpointer
    components: Callable[[], dict[str, Any]]
    step: Callable[[], int]  # the trainer's step, after a load
    events: EventLog
    is_main: bool
    lineage: list[dict[str, Any]] = field(default_factory=list)  # checkpoints this run continues
    run_dir: Path | None = None  # where rollbacks record their skipped ranges (SKIPS)
    branch: dict[str, Any] | None = None  # the branch the loaded checkpoint starts, if any

    def start(self, mode: ResumeMode, run_dir: Path, spec: RunSpec) -> bool:
        """Act on the resume rule (`run.resume`): load the newest checkpoint whose files all
        verify, naming every newer one that did not and why; or start from step 0 (fresh, or a
        run that never committed one). True when the loaded checkpoint ends the run (a restart or
        requeue after its last step): nothing is left to train."""
        if mode is ResumeMode.FRESH:
            return False
        checkpoint, rejected = self.checkpointer.find_valid()
        for verdict in rejected:
            self.events.emit("checkpoint_rejected", self.step(), path=str(verdict.path),
                             problems=list(verdict.problems))
        if checkpoint is None and not rejected:
            if self.is_main:
                print(f"note: no checkpoint in {self.checkpointer.root} yet: training from step 0 "
                      "in the same run directory", file=sys.stderr)
            return False
        if checkpoint is None:
            details = "; ".join(f"{v.path.name}: {', '.join(v.problems)}" for v in rejected)
            raise UserError(f"no valid checkpoint to resume in {self.checkpointer.root}"
                            f"{': ' + details if details else ''}. Restore the damaged files "
                            "from a copy, or start a fresh run (a new run directory).")
        if rejected and self.is_main:
            for verdict in rejected:
                print(f"warning: skipping checkpoint {verdict.path.name}: "
                      f"{'; '.join(verdict.problems)}", file=sys.stderr)
            print(f"warning: resuming from {checkpoint.name}, the newest checkpoint that "
                  "verifies", file=sys.stderr)
        saved = rundir.checkpoint_spec(checkpoint)
        if saved is not None:
            check_compatible(saved, spec, str(checkpoint))
        self.load(checkpoint)
        return complete(self.step(), spec, saved or {}, str(run_dir))

    def load(self, checkpoint: Location) -> None:
        """Restore every component from `checkpoint`, then the skips recorded since (a rollback
        persists its skipped range at once, so a crash before the next save does not train the
        batches that diverged again)."""
        t0 = time.perf_counter()
        components = self.components()
        meta = self.checkpointer.load(checkpoint, components)
        data = components.get("data")
        if data is not None and self.run_dir is not None:
            for start, end in read_skips(self.run_dir):
                data.skip(start, end)
        seconds = time.perf_counter() - t0
        size = sum(int(f.get("size", 0)) for f in meta.get("files", {}).values())
        self.lineage = manifest.lineage_after_resume(checkpoint)
        self.branch = branch_marked(self.run_dir, checkpoint)  # `train --resume --from`
        if self.branch is not None:
            self.lineage[-1]["branch"] = self.branch
        self.events.emit("resume", self.step(), path=str(checkpoint), branch=self.branch,
                         from_layout=meta.get("layout"), from_world_size=meta.get("world_size"),
                         load_s=round(seconds, 4), bytes=size,
                         load_bytes_per_s=round(size / seconds) if seconds > 0 else None)


@dataclass
class NumericsGuard:
    """Rolls back after `patience` consecutive steps with non-finite gradients (fp16 overflows
    excluded: the loss scaler backs off for those; 0 = never)."""

    patience: int
    recovery: Recovery
    train_data: TrainBatches
    ledger: LedgerWriter
    ctx: DistContext
    layout: BatchLayout
    events: EventLog
    scaled: bool  # fp16 with a loss scaler
    max_rollbacks: int = 3
    pause: Callable[[], Any] = contextlib.nullcontext  # steps the hang watchdog aside
    _bad_steps: int = 0
    _bad_from: int = 0
    _rollbacks: int = 0

    def check(self, result: StepResult) -> bool:
        """Count the step; True if it triggered a rollback (the loop goes on from the
        checkpoint's step)."""
        if not result.skipped or self.scaled:
            self._bad_steps = 0
            return False
        if self._bad_steps == 0:
            self._bad_from = self.train_data.consumed_samples - self.layout.global_batch
        self._bad_steps += 1
        self.events.emit("nonfinite", result.step, loss=result.loss, grad_norm=result.grad_norm,
                         consecutive=self._bad_steps)
        if not self.patience or self._bad_steps < self.patience:
            return False
        bad_to = self.train_data.consumed_samples
        if self._rollbacks >= self.max_rollbacks:
            raise UserError(
                f"training diverged again: {self._bad_steps} consecutive non-finite steps up to "
                f"step {result.step}, after {self._rollbacks} rollbacks in this launch (samples "
                f"{', '.join(f'[{a}, {b})' for a, b in self.train_data.skips)} skipped). The "
                "state diverges whatever the batch: lower optimizer.lr, raise "
                "optimizer.warmup_steps or grad_clip, or resume from an earlier checkpoint. "
                "failure.max_rollbacks sets how many rollbacks a launch may make.")
        with self.pause():  # hashing a large checkpoint is no hang
            self._roll_back(result, bad_to)
        return True

    def _roll_back(self, result: StepResult, bad_to: int) -> None:
        checkpoint, _ = self.recovery.checkpointer.find_valid()
        if checkpoint is None:
            raise UserError(
                f"training diverged: {self._bad_steps} consecutive steps with non-finite "
                f"gradients (up to step {result.step}) and no checkpoint to roll back to. Lower "
                "optimizer.lr, set checkpoint.every so there is one, or inspect the data.")
        if self.ctx.is_main and self.recovery.run_dir is not None:  # before anything else
            record_skip(self.recovery.run_dir, self._bad_from, bad_to)
        self._rollbacks += 1
        self.recovery.load(checkpoint)
        self.train_data.skip(self._bad_from, bad_to)
        step = self.recovery.step()
        self.ledger.count_launches()
        if self.ctx.distributed:
            dist.barrier()
        self.ledger.start_launch(step, self.ctx.world_size, self.ctx.dims.dp,
                                 self.layout.global_batch, skipped=(self._bad_from, bad_to))
        self.events.emit("rollback", step, path=str(checkpoint),
                         skipped_samples=[self._bad_from, bad_to], bad_steps=self._bad_steps,
                         rollback=self._rollbacks)
        self._bad_steps = 0


#: RUN_DIR/skipped.json: every sample range a rollback skipped, written when it skips
SKIPS = "skipped.json"


def record_skip(run_dir: Path, start: int, end: int) -> None:
    ranges = read_skips(run_dir)
    if [start, end] not in ranges:
        atomic_write_text(run_dir / SKIPS, json.dumps([*ranges, [start, end]]))


def read_skips(run_dir: Path) -> list[list[int]]:
    try:
        return [[int(a), int(b)] for a, b in json.loads((run_dir / SKIPS).read_text())]
    except (FileNotFoundError, ValueError, TypeError):
        return []
