"""Functions that run inside spawned test ranks (importable by the spawn start method)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.state import full_model_state
from shardwise.run import rundir
from shardwise.run.trainer import Trainer
from shardwise.run.worker import dump_final_state, run_worker
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
        # buckets of the last step whose reduction started during backward, and all of them
        "buckets": None if trainer.optimizers.overlap is None else (
            trainer.optimizers.overlap.early, len(trainer.optimizers.overlap.buckets)),
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


def train_many(store: Any, specs: list[RunSpec]) -> None:
    """Train each spec in turn in these ranks (one process group per run, each on its own prefix
    of the parent's store), writing only their run directories: runs that share the start-up."""
    import torch.distributed as dist

    for i, spec in enumerate(specs):
        run_dir = Path(spec.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        rundir.write_spec(run_dir, spec)
        run_worker(spec, run_dir, store=dist.PrefixStore(f"run-{i}/", store), ui=False)


def train_and_dump(store: Any, spec: RunSpec, resume: bool = False) -> None:
    """Train a fresh run as a worker of `shardwise verify` does (`--dump-state`): rank 0 writes
    the final parameters and optimizer state to the run directory (tests/support/verify.py)."""
    run_worker(spec, Path(spec.run.dir), resume=resume, store=store, ui=False,
               after_fit=dump_final_state)


def train_single(spec: RunSpec, resume: bool = False) -> dict[str, Any]:
    """The single-process reference, in the calling process (no process group). Restores the
    process-wide settings a determinism mode changes (threads, deterministic algorithms)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return train(None, spec, resume)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


SYNC_METHODS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "numpy",
                "cpu", "__array__")


class HostSyncCounter(torch.overrides.TorchFunctionMode):
    """Counts the tensor methods that read a value on the host (a device sync on a GPU).

    Reads made by torch.optim are left out: AdamW reads its step counter, which lives in host
    memory unless the optimizer is fused (CUDA's default here), where it stays on the device and
    is never read — neither is a device sync."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS and "torch/optim/" not in sys._getframe(1).f_code.co_filename:
            self.calls.append(f"{name} ({_caller()})")
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    frame = sys._getframe(2)
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def host_reads_per_step(store: Any, spec: RunSpec, steps: int) -> list[list[str]]:
    """Train `steps` steps through `Trainer.steps()` (the hot path, no hooks) and return, for
    every step after the first two, the host reads it made."""
    from shardwise.data import prepare_data
    from shardwise.parallel.distributed import init_distributed, shutdown
    from shardwise.telemetry import EventLog

    run_dir = Path(spec.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed(spec.parallel, store)
    try:
        trainer = Trainer(spec, ctx, run_dir, prepare_data(spec.data), EventLog("t", ctx.rank, []))
        gen = trainer.steps()
        per_step = []
        for i in range(steps):
            counter = HostSyncCounter()
            with counter:
                next(gen)
            if i >= 2:
                per_step.append(counter.calls)
        trainer.monitors.close()
        return per_step
    finally:
        shutdown(clean=True)


def activation_dtypes(store: Any, spec: RunSpec) -> dict[str, str]:
    """The output dtype of every module during one training step."""
    from shardwise.data import prepare_data
    from shardwise.parallel.distributed import init_distributed, shutdown
    from shardwise.parallel.parallelize import unwrap
    from shardwise.telemetry import EventLog

    run_dir = Path(spec.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = init_distributed(spec.parallel, store)
    try:
        trainer = Trainer(spec, ctx, run_dir, prepare_data(spec.data), EventLog("t", ctx.rank, []))
        seen: dict[str, str] = {}

        def record(name: str) -> Any:
            def hook(module: Any, args: Any, out: Any) -> None:
                if torch.is_tensor(out):
                    seen.setdefault(name, str(out.dtype))
            return hook

        for part in trainer.model.parts:
            for name, module in unwrap(part).named_modules():
                module.register_forward_hook(record(name))
        next(trainer.steps())
        trainer.monitors.close()
        return seen
    finally:
        shutdown(clean=True)


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


def train_with_slow_start(store: Any, spec: RunSpec, slow_rank: int, seconds: float) -> int:
    """Train with one rank's data preparation taking `seconds` longer (a cold corpus on one node,
    a large model directory hashed by rank 0); return the step reached."""
    import time

    import shardwise.run.worker as worker

    real = worker.prepare_data

    def slow(data: Any) -> Any:
        import torch.distributed as dist

        if dist.get_rank() == slow_rank:
            time.sleep(seconds)
        return real(data)

    worker.prepare_data = slow
    try:
        return int(train(store, spec)["step"])
    finally:
        worker.prepare_data = real
