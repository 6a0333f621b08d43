"""Start a run: `preflight`, then the run directory (new or resumed), the workers (in this
process for one, else through the elastic agent), the Hugging Face export at the end."""

from __future__ import annotations

import sys
from pathlib import Path

from shardwise.parallel.dims import ParallelDims
from shardwise.run.agent import Preempted, WorkersFailed, check_preempted, launch_local
from shardwise.run.preflight import preflight
from shardwise.spec.runspec import RunSpec

__all__ = ["Preempted", "WorkersFailed", "launch", "run_local", "start_run"]


def start_run(spec: RunSpec, dims: ParallelDims, resume: str | None,
              branch_from: str | None = None) -> Path:
    """After `preflight`: the run directory (new, or the one resumed, checked before any worker
    starts; `branch_from`, a step or registry name, first makes the branch `run.branch`
    describes), the spec written into it, the workers run; returns the directory. Raises
    WorkersFailed when they fail."""
    from shardwise.run import rundir

    if resume:
        run_dir = rundir.existing_run_dir(resume)
        if branch_from is not None:
            from shardwise.run.branch import make_branch

            for note in make_branch(run_dir, spec, branch_from, rundir.run_id(run_dir)):
                print(note, file=sys.stderr)
        point = rundir.resume_point(run_dir, spec)  # refuse here, before starting any worker
        for note in point.notes:
            print(note, file=sys.stderr)
        if point.complete:
            print(f"{run_dir} is complete: its checkpoint {point.checkpoint.name} is at step "
                  f"{point.step}, the last (run.steps = {spec.run.steps}); nothing to train. To "
                  f"train further, resume with --set run.steps=N for some N > {point.step}.",
                  file=sys.stderr)
            return run_dir
    else:
        if spec.checkpoint.enabled:
            rundir.check_fresh_location(spec)  # before the run directory exists
        run_dir = rundir.new_run_dir(spec)
    rundir.write_spec(run_dir, spec)
    nproc = spec.parallel.nproc
    print(f"run directory: {run_dir}  ({dims.describe()}, {nproc} worker"
          f"{'s' if nproc > 1 else ''})", file=sys.stderr)
    run_local(spec, run_dir, resume is not None)
    if spec.checkpoint.hf_export:
        export_hf_at_end(spec, run_dir)
    return run_dir


def export_hf_at_end(spec: RunSpec, run_dir: Path) -> None:
    """`checkpoint.hf_export`: the run's newest checkpoint as a from_pretrained directory."""
    from shardwise.checkpoint.discovery import checkpoint_at
    from shardwise.run.export import export_hf_dir

    out = Path(spec.checkpoint.hf_export).expanduser()
    out = out if out.is_absolute() else run_dir / out
    checkpoint = checkpoint_at(run_dir)
    export_hf_dir(checkpoint, out, spec)
    print(f"exported {checkpoint.name} to {out} (AutoModelForCausalLM.from_pretrained loads it)",
          file=sys.stderr)


def launch(spec: RunSpec, resume: str | None = None) -> Path:
    """`preflight` and `start_run`: what `shardwise train` and `shardwise.train` do."""
    spec, dims = preflight(spec)
    return start_run(spec, dims, resume)


def run_local(spec: RunSpec, run_dir: Path, resume: bool, dump_state: bool = False) -> None:
    """Train `spec` in RUN_DIR on `parallel.nproc` local workers (in this process when 1).
    Raises Preempted when a preemption signal stopped it after a committed checkpoint."""
    if spec.parallel.nproc == 1:
        from shardwise.run.worker import dump_final_state, run_worker

        run_worker(spec, run_dir, resume=resume, after_fit=dump_final_state if dump_state else None)
    else:
        launch_local(run_dir, spec.parallel.nproc, resume,
                     max_restarts=spec.failure.max_restarts,
                     worker_args=("--dump-state",) if dump_state else (),
                     preempt_signals=spec.failure.preempt_signals,
                     grace_s=spec.failure.preempt_grace_s)
    check_preempted(run_dir)
