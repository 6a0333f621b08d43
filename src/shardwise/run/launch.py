"""Start N local workers through torch's elastic agent — the engine behind torchrun.

Rendezvous is c10d on localhost port 0, so the agent binds a free port: parallel jobs on one
machine never collide on a fixed port.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from shardwise.data import PreparedData
from shardwise.parallel.dims import ParallelDims
from shardwise.resilience.preempt import (
    PREEMPTED_EXIT,
    agent_signals,
    marker_message,
    read_marker,
)
from shardwise.spec.runspec import RunSpec

#: Workers started by `launch_local` write user errors here instead of printing them N times.
ERRORS_DIR = ".worker-errors"


class WorkersFailed(Exception):
    """One or more workers exited non-zero; `exit_code` is 2 when all failed on a user error."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(WorkersFailed):
    """A preemption signal stopped the run after a committed checkpoint (exit code 75)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PREEMPTED_EXIT)


def check_preempted(run_dir: Path) -> None:
    """Raise Preempted when this launch's workers stopped on a preemption signal."""
    marker = read_marker(run_dir)
    if marker is not None:
        raise Preempted(marker_message(run_dir, marker))


def launch_local(run_dir: Path, nproc: int, resume: bool, max_restarts: int = 0,
                 worker_args: tuple[str, ...] = (), preempt_signals: str = "",
                 grace_s: float = 30.0, then: tuple[Path, ...] = ()) -> None:
    """Run `python -m shardwise.run.worker RUN_DIR` on `nproc` local workers and wait (with
    `then`, the workers train those fresh run directories after RUN_DIR, in the same launch). A
    preemption signal to this process is forwarded to the workers, which get `grace_s` to
    commit their checkpoint before the agent kills them."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        # Our own message below names the failed ranks; the agent's log lines would repeat it.
        logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"shardwise-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
        monitor_interval=0.1, **_agent_signal_options(preempt_signals, grace_s),
    )
    args = ["-m", "shardwise.run.worker", str(run_dir), *map(str, then),
            *(["--resume"] if resume else []), *worker_args]
    errors = run_dir / ERRORS_DIR
    shutil.rmtree(errors, ignore_errors=True)
    try:
        elastic_launch(config, sys.executable)(*args)
    except SignalException as err:  # the agent forwarded it and waited for the workers
        check_preempted(run_dir)
        raise WorkersFailed(
            f"stopped by {signal.Signals(err.sigval).name} before the workers committed a "
            f"preemption checkpoint (failure.preempt_signals does not list it, or the save took "
            f"longer than failure.preempt_grace_s = {grace_s:g}). Continue from the last "
            f"checkpoint with `shardwise train --resume {run_dir}`.", 1) from None
    except ChildFailedError as err:
        codes = {rank: failure.exitcode for rank, failure in err.failures.items()}
        messages = sorted({p.read_text() for p in errors.glob("rank-*.txt")})
        if messages:  # a user error, the same on every rank that saw it: say it once
            raise WorkersFailed(" ".join(messages), 2) from None
        listed = ", ".join(f"rank {r} exit code {c}" for r, c in sorted(codes.items()))
        diagnosis = explain_failure(run_dir, nproc)
        if diagnosis:
            print(f"\n{diagnosis}", file=sys.stderr, flush=True)
        raise WorkersFailed(
            f"training failed: {listed} (a negative code is the signal that stopped it). The "
            f"workers' own output is above; the run directory {run_dir} keeps everything "
            f"written so far: continue from its last checkpoint with `shardwise train --resume "
            f"{run_dir}`.", 1) from None
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def _agent_signal_options(preempt_signals: str, grace_s: float) -> dict[str, object]:
    """LaunchConfig's signal fields where this torch has them (older ones read the env)."""
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    options: dict[str, object] = {}
    if "signals_to_handle" in fields:
        options["signals_to_handle"] = agent_signals(preempt_signals)
    else:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = agent_signals(preempt_signals)
    if "shutdown_timeout" in fields:
        options["shutdown_timeout"] = max(1, math.ceil(grace_s))
    return options


def explain_failure(run_dir: Path, world: int) -> str:
    """The hang report of the last attempt if a watchdog wrote one; otherwise a diagnosis of the
    ranks' flight records when they show a mismatch or a rank that fell behind (gloo aborts a
    process on a collective mismatch, so that rank could not say it). Written to
    RUN_DIR/diagnostics/attempt-N/hang-report.txt and appended to metrics.jsonl as a `hang`
    event. Empty when the records show nothing wrong with the collectives."""
    from shardwise.resilience.flight import read_all
    from shardwise.resilience.hang import REPORT, append_event, diagnose, latest_attempt_dir, save

    directory = latest_attempt_dir(run_dir)
    if directory is None:
        return ""
    if not (directory / REPORT).exists():
        flights = read_all(directory)
        diagnosis = diagnose(flights, world)
        if not flights or not diagnosis.diverged:
            return ""
        save(directory, diagnosis,
             diagnosis.text(f"FAILED: the workers of {directory.name} died; their flight "
                            "records show a collective problem."),
             max(f.step for f in flights))
    append_event(run_dir, directory, source="launcher")
    return (directory / REPORT).read_text()


def with_data_hashes(spec: RunSpec, data: PreparedData) -> RunSpec:
    """The spec with the data and tokenizer hashes filled in, so a later resume can check them."""
    return spec.replace("data", content_hash=data.content_hash, tokenizer_hash=data.tokenizer_hash)


def with_model_tokenizer(spec: RunSpec) -> RunSpec:
    """A model fine-tuned from a directory (`model.hf_path`) reads text with its own tokenizer:
    `data.tokenizer` is set to the directory's tokenizer.json unless the user named one."""
    if spec.model.family != "hf" or not spec.model.hf_path:
        return spec
    from shardwise.data import resolve_tokenizer
    from shardwise.models.hf.build import hf_dir

    return dataclasses.replace(spec, data=resolve_tokenizer(spec.data, hf_dir(spec.model)))


def preflight(spec: RunSpec, data: PreparedData | None = None) -> tuple[RunSpec, ParallelDims]:
    """Every check that needs no worker, before any worker starts: the worker count against the
    machine's GPUs (and `nproc = 0` resolved to a number), layout against the world size, batch
    against the data-parallel degree, layout against the model; the data is prepared here
    (unless `data`, prepared from the same `spec.data`, is given: `shardwise verify` checks many
    layouts of one job) and its hashes are pinned into the returned spec."""
    from shardwise.data import BatchLayout, prepare_data
    from shardwise.models.registry import describe_model
    from shardwise.parallel.checks import check_layout
    from shardwise.parallel.devices import resolve_backend, resolve_device_type, resolve_nproc
    from shardwise.parallel.support import check_torch_supports

    spec = with_model_tokenizer(spec)
    device_type = resolve_device_type(spec.parallel)
    check_torch_supports(spec, resolve_backend(spec.parallel, device_type))
    spec = spec.replace("parallel", nproc=resolve_nproc(spec.parallel, device_type))
    dims = ParallelDims.from_spec(spec.parallel, spec.parallel.nproc)
    layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, dims.dp)
    if data is None:  # after the cheap checks: preparing a corpus can take a while
        data = prepare_data(spec.data)
    plan = describe_model(spec.model, data.vocab_size, spec.data.seq_len)
    if dims.cp > 1 and spec.model.family == "hf":
        from shardwise.models.hf.attention import check_context_parallel
        from shardwise.models.hf.build import load_config

        check_context_parallel(load_config(spec.model, data.vocab_size, spec.data.seq_len))
    check_layout(spec, dims, plan, layout.accumulation)
    check_memory(spec, dims, plan, device_type)
    return with_data_hashes(spec, data), dims


def check_memory(spec: RunSpec, dims: ParallelDims, plan, device_type: str) -> None:
    """The will-it-fit check (`shardwise.plan.fit`): one warning line on stderr when the memory
    model predicts a rank will not fit its device; with `plan.strict = true` a UserError (exit 2)
    with the numbers instead. Silent when it fits, and when a GPU's memory cannot be read cheaply."""
    from shardwise.errors import UserError
    from shardwise.plan.cluster import _physical_memory_bytes
    from shardwise.plan.fit import check_fit

    workers = spec.parallel.nproc
    if spec.plan.device_memory_gib > 0:
        capacity = spec.plan.device_memory_gib * 2**30
        source = f"plan.device_memory_gib = {spec.plan.device_memory_gib:g}"
    elif device_type == "cpu":
        total = _physical_memory_bytes()
        capacity = total / workers
        source = (f"this machine's {total / 2**30:.1f} GiB of RAM shared by {workers} local "
                  f"worker{'s' if workers > 1 else ''}")
    else:
        memory = cuda_device_memory()
        if memory is None:
            return
        capacity, source = memory, "the GPU"
    result = check_fit(spec, dims, dims.zero, plan.shape, bool(plan.tied), device_type, capacity,
                       source)
    if result.fits:
        return
    if spec.plan.strict:
        raise UserError(f"{result.numbers()}, and plan.strict = true refuses to start a run "
                        "predicted not to fit. Shard more (a higher parallel.zero, tp or pp), "
                        "checkpoint activations (memory.activation_checkpoint), lower "
                        "batch.micro_batch, or see `shardwise plan --model SPEC.toml --cluster "
                        "...` for layouts that fit; set plan.strict = false to start it anyway.")
    print(f"warning: {result.numbers()}; it may run out of memory (plan.strict = true refuses "
          "such runs; `shardwise plan --model SPEC.toml` lists layouts that fit).",
          file=sys.stderr)


def cuda_device_memory() -> float | None:
    """Total memory of the first GPU, only where reading it costs nothing: from torch when this
    process has initialised CUDA already (initialising it here would cost the launcher seconds and
    a context), else from NVML when `pynvml` is installed; None otherwise."""
    import torch

    if torch.cuda.is_initialized():
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no device: no check, no message
        return None


def plan_preview(spec: RunSpec, dims: ParallelDims) -> str:
    """What `--print-plan` shows: every parameter's placement under `dims`, the pipeline stage
    map, the FSDP units, the tied groups (the model built on the meta device; after `preflight`,
    so the data is prepared and cached)."""
    from shardwise.data import prepare_data
    from shardwise.models.plan import plan_of
    from shardwise.models.registry import build_model
    from shardwise.parallel.placement import render

    data = prepare_data(spec.data)
    model = build_model(spec.model, data.vocab_size, spec.data.seq_len, seed=0, device="meta")
    return render(model, plan_of(model), dims, spec.parallel.pp_virtual_stages,
                  spec.parallel.pp_schedule, spec.parallel.pp_layer_split)


def start_run(spec: RunSpec, dims: ParallelDims, resume: str | None) -> Path:
    """After `preflight`: the run directory (new, or the one resumed, checked before any worker
    starts), the spec written into it, the workers run; returns the directory. Raises
    WorkersFailed when they fail."""
    from shardwise.run import rundir

    if resume:
        run_dir = rundir.existing_run_dir(resume)
        rundir.resume_checkpoint(run_dir, spec)  # fail here, before starting any worker
    else:
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
    from shardwise.checkpoint.export import export_hf_dir, newest_checkpoint

    out = Path(spec.checkpoint.hf_export).expanduser()
    out = out if out.is_absolute() else run_dir / out
    checkpoint = newest_checkpoint(run_dir)
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
