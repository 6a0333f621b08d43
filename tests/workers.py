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


class _Holder:
    """A component whose state is a dict of tensors, as the checkpointer expects."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.update(state)  # DCP loaded the tensors in place; other values are new


def stage_dtensors(store: Any, root: str) -> dict[str, Any]:
    """World 2 on gloo: DTensors (a 5-row Shard(0), so local shapes 3 and 2, and a Replicate)
    staged by a HostStager and saved by an async Checkpointer with `DTensor.from_local`
    replaced by a function that raises. Reports what each rank saw."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardwise.checkpoint.checkpointer import Checkpointer
    from shardwise.checkpoint.staging import HostStager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        live = {"w": distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]),
                "b": distribute_tensor(torch.randn(4), mesh, [Replicate()]), "step": 7}
        real = DTensor.from_local

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("DTensor.from_local called while staging")

        DTensor.from_local = refuse  # type: ignore[method-assign]
        try:
            stager = HostStager()
            staged = stager.stage(live)
            first_ptrs = [staged[k]._local_tensor.data_ptr() for k in ("w", "b")]
            report = {
                "types": [type(staged[k]).__name__ for k in ("w", "b")],
                "local_devices": [staged[k]._local_tensor.device.type for k in ("w", "b")],
                "local_shapes": [tuple(staged[k]._local_tensor.shape) for k in ("w", "b")],
                "shapes": [tuple(staged[k].shape) for k in ("w", "b")],
                "same_spec": all(staged[k].placements == live[k].placements
                                 and staged[k].device_mesh == live[k].device_mesh for k in ("w", "b")),
                "equal": all(torch.equal(staged[k]._local_tensor, live[k]._local_tensor)
                             for k in ("w", "b")),
                "shares_memory": any(staged[k]._local_tensor.data_ptr() == live[k]._local_tensor.data_ptr()
                                     for k in ("w", "b")),
                "step": staged["step"],
            }
            before = staged["w"]._local_tensor.clone()
            live["w"]._local_tensor.add_(1.0)
            report["unchanged_after_live_update"] = torch.equal(staged["w"]._local_tensor, before)
            again = stager.stage(live)
            report["reused"] = [again[k]._local_tensor.data_ptr() for k in ("w", "b")] == first_ptrs
            report["restaged_equal"] = torch.equal(again["w"]._local_tensor, live["w"]._local_tensor)
            report["builds"] = stager.builds
            saver = Checkpointer(Path(root), rank, True, async_save=True, timeout_s=60)
            saver.save(3, {"m": _Holder(live)}, {})
            record = saver.wait()
            report["host_staging_bytes"] = record.host_staging_bytes if record else None
            report["stager_nbytes"] = saver.stager.nbytes
            report["device_peak_bytes"] = record.device_peak_bytes if record else "missing"
        finally:
            DTensor.from_local = real  # type: ignore[method-assign]
        target = {"w": distribute_tensor(torch.zeros(5, 3), mesh, [Shard(0)]),
                  "b": distribute_tensor(torch.zeros(4), mesh, [Replicate()]), "step": 0}
        path, _ = saver.find_valid()
        saver.load(path, {"m": _Holder(target)})
        report["loaded_equal"] = all(torch.equal(target[k].full_tensor(), live[k].full_tensor())
                                     for k in ("w", "b"))
        return report
    finally:
        dist.destroy_process_group()
