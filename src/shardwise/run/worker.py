"""What every worker process runs: join the group, load data, build the trainer, fit.

Started three ways, all ending in `run_worker`:
- `shardwise train --nproc N` launches `python -m shardwise.run.worker RUN_DIR` through torch's
  elastic agent after resolving the spec and preparing the data once;
- `torchrun ... -m shardwise train CONFIG` runs the CLI in every worker (`run_under_torchrun`);
- tests call `run_worker` directly inside their own processes.
"""

from __future__ import annotations

if __name__ == "__main__":  # a launched worker: preemption handled before torch is imported
    import faulthandler

    from shardwise.resilience.preempt import catch_early

    # a crash in native code (SIGSEGV, SIGBUS, SIGABRT, ...) prints every thread's Python stack
    # to the worker's stderr before the process dies of it: the launcher's message points there
    faulthandler.enable(all_threads=True)
    catch_early()

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.compat import TorchPatches
from shardwise.data import PreparedData, prepare_data
from shardwise.errors import UserError
from shardwise.models.registry import model_source
from shardwise.parallel.distributed import DistContext, init_distributed, launcher_store, shutdown
from shardwise.resilience.faults import FaultInjector
from shardwise.resilience.peers import peer_lost
from shardwise.resilience.preempt import SignalFlag, write_marker
from shardwise.run import rundir
from shardwise.run.hooks import user_hook_setups
from shardwise.run.preflight import with_data_hashes
from shardwise.run.resume import ResumeMode, restart_attempt, resume_mode
from shardwise.run.rundir import ERRORS_DIR
from shardwise.run.startup import Startup, StoppedAtStartup, install_flag
from shardwise.run.trainer import Trainer, TrainSummary
from shardwise.spec import RunSpec
from shardwise.telemetry import EventLog, JsonlSink, TensorBoardSink
from shardwise.telemetry.optional import check_optional_sinks, optional_sinks
from shardwise.telemetry.progress import ProgressSink


def run_worker(spec: RunSpec, run_dir: Path, resume: bool = False,
               store: dist.Store | None = None, ui: bool = True,
               after_fit: Callable[[Trainer], Any] | None = None) -> TrainSummary:
    """Train in this process as one rank of the world named by the environment. `resume` is
    whether the user asked to continue the run; restarts are decided by `run.resume`.

    `after_fit(trainer)` runs on every rank after training (it may use collectives); its result
    is returned as `summary.extra` — tests use it to gather the final parameters.
    """
    flag = install_flag(spec.failure.preempt_signals)  # first: from here a signal is a preemption
    ctx = _init(spec, store)
    clean = False
    try:
        summary = _train(spec, ctx, run_dir, resume_mode(resume), ui, flag, after_fit)
        clean = True
        return summary
    finally:
        shutdown(clean)


def _init(spec: RunSpec, store: dist.Store | None = None) -> DistContext:
    return init_distributed(spec.parallel, store, deterministic=spec.run.determinism != "fast")


def _train(spec: RunSpec, ctx: DistContext, run_dir: Path, mode: ResumeMode, ui: bool,
           flag: SignalFlag, after_fit: Callable[[Trainer], Any] | None = None,
           prepared: tuple[Startup, PreparedData, dict[str, Any] | None] | None = None
           ) -> TrainSummary:
    """`prepared`: the start-up so far and what its data phase made (torchrun's entry prepares
    before it agrees on the run directory)."""
    try:
        if prepared is None:
            startup = _startup(spec, ctx, flag)
            startup.arrive("join")
            data, source = _prepare_everywhere(spec, startup)
        else:
            startup, data, source = prepared
        # the hashes of the data these workers read, whatever the spec pinned: a resume
        # compares them with the checkpoint's (prepare_data already refused pinned ones that
        # differ), so unpinned specs (a library call, a hand-written spec.toml) are checked too
        spec = with_data_hashes(spec, data)
        events = _event_log(spec, ctx, run_dir, ui)
    except StoppedAtStartup as stop:
        return _stopped(run_dir, ctx, stop)
    # the runtime: every change shardwise makes to torch (the meta build's, the comm tap's) is
    # made through `patches` and undone when the run ends, however it ends
    with TorchPatches() as patches:
        try:
            trainer = Trainer(spec, ctx, run_dir, data, events, patches, flag, source)
            for setup in user_hook_setups(spec.run.hooks):
                setup(trainer)
            startup.arrive("model")
            trainer.start(mode)
            startup.arrive("resume")
            summary = trainer.fit()
            if after_fit is not None:
                summary.extra = after_fit(trainer)
            return summary
        except StoppedAtStartup as stop:
            events.emit("preempted", 0, signal=stop.signal_name, phase=stop.phase,
                        checkpoint=None)
            return _stopped(run_dir, ctx, stop)
        finally:
            events.close()


def _startup(spec: RunSpec, ctx: DistContext, flag: SignalFlag) -> Startup:
    return Startup(flag, ctx.rank, ctx.world_size, ctx.store if ctx.distributed else None,
                   FaultInjector.from_spec(spec.failure.faults, ctx.rank))


def _stopped(run_dir: Path | None, ctx: DistContext, stop: StoppedAtStartup) -> TrainSummary:
    """A preemption before the first step: nothing to save, nothing lost. The marker makes the
    launcher exit 75; the next launch continues from the newest checkpoint, or step 0. (Under
    torchrun with neither --resume nor run.dir there is no run directory yet to mark.)"""
    if ctx.is_main:
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_marker(run_dir, {"signal": stop.signal_name, "step": None,
                                   "checkpoint": None, "phase": stop.phase})
        print(f"{stop}: stopped before the first step; nothing was lost", file=sys.stderr)
    summary = TrainSummary()
    summary.preempted = {"step": None, "signal": stop.signal_name, "checkpoint": None}
    return summary


def _prepare_everywhere(spec: RunSpec, startup: Startup
                        ) -> tuple[PreparedData, dict[str, Any] | None]:
    """Every rank prepares the data; `prepare_data` serialises the ranks of a
    node on the cache's lock, so the first builds the caches and the others read them. Rank 0
    also hashes what pins the model's code (every file of `model.hf_path`: minutes for a large
    model, the first time). The ranks then meet in the store, not in a collective, so none of
    this races `parallel.timeout_s`; a user error on any rank is raised on all."""
    error: UserError | None = None
    source: dict[str, Any] | None = None
    data: PreparedData | None = None
    try:
        data = prepare_data(spec.data)
        if startup.rank == 0:
            source = model_source(spec.model.family, spec.model)
    except UserError as err:
        error = err
    startup.arrive("data", error)
    assert data is not None  # arrive raised otherwise
    return data, source


def _event_log(spec: RunSpec, ctx: DistContext, run_dir: Path, ui: bool) -> EventLog:
    check_optional_sinks(spec.telemetry)
    sinks = []
    if ctx.is_main:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if spec.log.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        if ui and spec.log.progress:
            sinks.append(ProgressSink(spec.run.stop_at or spec.run.steps, 0))
        sinks.extend(optional_sinks(spec.telemetry, run_dir, spec.run.name, spec.to_dict()))
    return EventLog(run_dir.name, ctx.rank, sinks)


def run_under_torchrun(spec: RunSpec, resume_dir: str | None) -> TrainSummary:
    """Entry when torchrun started the CLI: agree on one run directory, then train. The first
    attempt chooses the directory and records it in the launcher's store, which outlives the
    workers, so that an attempt after a restart (--max-restarts) finds the same run with or
    without run.dir; whether it resumes is `run.resume`'s rule, as for every launcher."""
    import faulthandler

    faulthandler.enable(all_threads=True)  # as a launched worker (see the top of this module)
    flag = install_flag(spec.failure.preempt_signals)
    ctx = _init(spec)
    clean = False
    try:
        startup = _startup(spec, ctx, flag)
        try:
            startup.arrive("join")
            data, source = _prepare_everywhere(spec, startup)
        except StoppedAtStartup as stop:  # before the run directory is agreed: the one named
            named = resume_dir or spec.run.dir
            summary = _stopped(Path(named).expanduser() if named else None, ctx, stop)
            clean = True
            return summary
        spec = with_data_hashes(spec, data)
        path = _agree_run_dir(spec, ctx, resume_dir)
        summary = _train(spec, ctx, path, resume_mode(resume_dir is not None), ui=True,
                         flag=flag, prepared=(startup, data, source))
        clean = True
        return summary
    finally:
        shutdown(clean)


RUN_DIR_KEY = "shardwise/run_dir"


def _agree_run_dir(spec: RunSpec, ctx: DistContext, resume_dir: str | None) -> Path:
    store = ctx.store
    if restart_attempt() > 0 and store is not None and store.check([RUN_DIR_KEY]):
        return Path(store.get(RUN_DIR_KEY).decode())
    holder: list[object] = [None]
    if ctx.is_main:
        try:
            path = rundir.existing_run_dir(resume_dir) if resume_dir else rundir.new_run_dir(spec)
            rundir.write_spec(path, spec)
            holder[0] = str(path)
            if store is not None:
                store.set(RUN_DIR_KEY, str(path.resolve()))
        except UserError as err:
            holder[0] = err
    if ctx.distributed:
        dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], UserError):
        raise holder[0]
    return Path(str(holder[0]))


FINAL_STATE = "final_state.pt"


def dump_final_state(trainer: Trainer) -> None:
    """Rank 0 saves every parameter and optimizer-state tensor, gathered to full tensors, to
    RUN_DIR/final_state.pt (collective; for `shardwise verify` on small models)."""
    from shardwise.checkpoint.state import full_model_state

    ctx = trainer.ctx
    pp_group = ctx.mesh["pp"].get_group() if ctx.mesh is not None and ctx.dims.pp > 1 else None
    params = full_model_state(trainer.model.parts, pp_group)
    optim = trainer.optimizers.full_state()
    if pp_group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, optim, group=pp_group)
        for other in gathered:
            optim.update(other)
    if ctx.is_main:
        torch.save({"params": params, "optim": optim}, trainer.run_dir / FINAL_STATE)


def run_in_turn(run_dirs: list[Path], after_fit: Callable[[Trainer], Any] | None) -> None:
    """Fresh runs one after another in these workers (verify's layouts of one world size): each
    on its own prefix of the launcher's store, so each has its own process group, while Python,
    torch and the model's imports start once. Restarts re-run the whole list, so the caller
    groups only runs without a failure policy."""
    specs = [rundir.load_run_spec(d, []) for d in run_dirs]
    base = launcher_store(max(s.parallel.timeout_s for s in specs))
    for i, (spec, run_dir) in enumerate(zip(specs, run_dirs, strict=True)):
        run_worker(spec, run_dir, store=dist.PrefixStore(f"/shardwise/run_{i}", base),
                   after_fit=after_fit)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardwise.run.worker RUN_DIR [RUN_DIR ...] [--resume]`, as started by
    `shardwise train` (one run directory) and `shardwise verify` (one per layout)."""
    parser = argparse.ArgumentParser(prog="shardwise-worker")
    parser.add_argument("run_dir", nargs="+",
                        help="a run directory; several (verify) train one after another")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dump-state", action="store_true",
                        help="save the full final parameters and optimizer state (verify)")
    args = parser.parse_args(argv)
    run_dirs = [Path(p) for p in args.run_dir]
    run_dir = run_dirs[0]  # the launch's own: where the launcher looks for errors
    after_fit = dump_final_state if args.dump_state else None
    try:
        if len(run_dirs) == 1:
            spec = rundir.load_run_spec(run_dir, [])
            run_worker(spec, run_dir, resume=args.resume, after_fit=after_fit)
        else:
            run_in_turn(run_dirs, after_fit)
    except UserError as err:
        # The launcher prints it once for all ranks (every rank usually hits the same error).
        (run_dir / ERRORS_DIR).mkdir(exist_ok=True)
        (run_dir / ERRORS_DIR / f"rank-{os.environ.get('RANK', '0')}.txt").write_text(str(err))
        return err.exit_code
    except Exception as err:
        lost = peer_lost(err)
        if lost is None:
            raise  # a defect: its traceback is the report
        print(f"rank {os.environ.get('RANK', '0')}: another worker or node went away "
              f"mid-collective ({lost[:200]}); the launcher restarts the workers from the "
              "newest checkpoint when failure.max_restarts allows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
