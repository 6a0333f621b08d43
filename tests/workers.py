"""Functions that run inside spawned test ranks (importable by the spawn start method)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.checkpointer import full_model_state
from shardwise.run import rundir
from shardwise.run.trainer import Trainer
from shardwise.run.worker import run_worker
from shardwise.spec import RunSpec


def _collect(trainer: Trainer) -> dict[str, Any]:
    """Full parameters (rank 0) and the global sample indices this rank reads next."""
    ctx = trainer.ctx
    pp_group = ctx.mesh["pp"].get_group() if ctx.mesh is not None and ctx.dims.pp > 1 else None
    params = full_model_state(trainer.model.parts, pp_group)
    return {
        "params": {k: v.detach().clone().float() for k, v in params.items()},
        "next_indices": [idx.tolist() for idx in trainer.train_data.step_indices()],
        "step": trainer.state.step,
        "threads": torch.get_num_threads(),
        "model_state": trainer.meter.report,
        "loss_scale": trainer.scaler.state_dict() if trainer.scaler else None,
        "optim": trainer.optimizers.full_state(),
    }


def train(store: Any, spec: RunSpec, resume: bool = False) -> dict[str, Any]:
    """Train (or resume) the run `spec` describes; return losses and the collected state."""
    run_dir = Path(spec.run.dir)
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_spec(run_dir, spec)
    summary = run_worker(spec, run_dir, resume=resume, store=store, ui=False, after_fit=_collect)
    return {"losses": summary.losses, "grad_norms": summary.grad_norms,
            "val_losses": summary.val_losses, **summary.extra}


def train_single(spec: RunSpec, resume: bool = False) -> dict[str, Any]:
    """The single-process reference, in the calling process (no process group). Restores the
    process-wide settings a determinism mode changes (threads, deterministic algorithms)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return train(None, spec, resume)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
