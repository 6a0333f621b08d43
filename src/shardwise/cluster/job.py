"""`shardwise launch`: resolve the spec and the run directory once, check what would break on a
cluster, then print (or run) one node's torchrun command, or write and submit a Slurm job.

Every node names the same run directory; the resolved spec goes to RUN_DIR/job.toml there, so
that no node needs the user's config file or overrides.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from shardwise.cluster import slurm, torchrun
from shardwise.cluster.filesystems import check_shared
from shardwise.errors import UserError
from shardwise.resilience.preempt import (
    PREEMPTED_EXIT,
    clear_marker,
    marker_message,
    parse_signals,
    read_marker,
)
from shardwise.spec import RunSpec, load_spec, spec_to_toml


@dataclass(frozen=True)
class Prepared:
    spec: RunSpec
    run_dir: Path
    created: bool  # this launch made the directory (removed again if submission fails)


def resolve(config: str | None, overrides: list[str], nnodes: int, *, local: bool,
            assume_shared: bool) -> tuple[RunSpec, Path]:
    """The spec and its absolute run directory, checked to be visible to every node (`local`:
    all nodes are this machine). Nothing is written yet."""
    spec = load_spec(config, overrides)
    if spec.run.dir:
        run_dir = Path(spec.run.dir).expanduser().absolute()
    elif nnodes > 1 and not local:
        raise UserError("a multi-node launch needs run.dir: every node must name the same run "
                        "directory, on a filesystem they all see. Set it in the config or with "
                        "--set run.dir=/shared/path/RUN.")
    else:
        run_dir = (Path("runs") / f"{spec.run.name}-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    if not (local or assume_shared):
        check_shared(run_dir, nnodes)
    return spec.replace("run", dir=str(run_dir)), run_dir


def materialize(spec: RunSpec, run_dir: Path) -> Prepared:
    """Create the run directory and write job.toml (a run that already started there is
    resumed instead and keeps its spec.toml)."""
    from shardwise.run.rundir import SPEC_FILE

    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / SPEC_FILE).exists():
            (run_dir / torchrun.JOB_SPEC).write_text(spec_to_toml(spec))
    except OSError as err:
        raise UserError(f"cannot write the run directory {run_dir} ({err.strerror}). Choose a "
                        "writable shared location with --set run.dir=PATH.") from None
    return Prepared(spec, run_dir, created)


def run_node(command: list[str], run_dir: Path, preempt_signals: str) -> int:
    """Run one node's agent (`shardwise.cluster.node`) and wait; PREEMPTED_EXIT (and the
    one-line message) when its workers stopped on a preemption signal, or when the agent lost
    the rendezvous store (it said so itself). A preemption signal sent to this process is passed
    on to the agent, which runs in a session of its own so that a terminal's or a process
    group's signal reaches it once."""
    from shardwise.cluster.node import LOST_MARKER, RESUMABLE_EXIT

    clear_marker(run_dir)
    (run_dir / LOST_MARKER).unlink(missing_ok=True)
    proc = subprocess.Popen(command, start_new_session=True)

    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    signals = {s for s in parse_signals(preempt_signals)} | {signal.SIGINT}
    previous = {s: signal.signal(s, forward) for s in signals}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code == RESUMABLE_EXIT:  # the agent printed why (the rendezvous store was lost)
        return code
    marker = read_marker(run_dir)
    if marker is not None:
        print(marker_message(run_dir, marker), flush=True)
        return PREEMPTED_EXIT
    return code


def submit_slurm(prepared: Prepared, job: slurm.SlurmJob, dry_run: bool) -> tuple[Path, str]:
    """Write RUN_DIR/slurm-job.sbatch and (unless `dry_run`) sbatch it; (script, job id). On a
    refused submission nothing is left behind: the directory this launch made is removed."""
    script = prepared.run_dir / slurm.SCRIPT
    script.write_text(slurm.render_script(prepared.spec, prepared.run_dir, job, Path.cwd()))
    script.chmod(0o755)
    if dry_run:
        return script, ""
    try:
        job_id = slurm.submit(script)
    except UserError:
        if prepared.created:
            shutil.rmtree(prepared.run_dir, ignore_errors=True)
        else:
            script.unlink(missing_ok=True)
        raise
    slurm.record(prepared.run_dir, job_id, script)
    return script, job_id


def check_slurm(spec: RunSpec, job: slurm.SlurmJob, dry_run: bool) -> None:
    """Everything about the Slurm job that can be refused before a directory is made."""
    slurm.check_job(spec, job)
    if not dry_run:
        slurm.require("sbatch", "scontrol")
        slurm.check_partition(job.partition)
