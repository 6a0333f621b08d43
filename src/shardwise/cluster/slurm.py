"""Slurm: the sbatch script of a job, its submission, and its state.

One task per node runs torchrun's agent (`cluster.node`); the rendezvous is on the first node of
the allocation, whose agent hosts its store (`is_host=true`). Slurm sends `--signal=USR1@GRACE`
that many seconds before the time limit (and `scancel --signal` or a preemption send what they
send): the workers commit a checkpoint and the script exits 75, after `scontrol requeue` when the
job was submitted with --requeue, so that the job continues from that checkpoint when it runs
again (a requeued script finds spec.toml in the run directory and resumes). When the other agents
lose the rendezvous store (its node is gone) they say so and the script exits 75 the same way.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from shardwise.cluster import torchrun
from shardwise.cluster.node import LOST_MARKER, RESUMABLE_EXIT
from shardwise.errors import UserError, show
from shardwise.resilience.preempt import MARKER, PREEMPTED_EXIT
from shardwise.spec.failure import parse_signals
from shardwise.spec.runspec import RunSpec

SCRIPT = "slurm-job.sbatch"
JOB_RECORD = "slurm-job.json"
#: the rendezvous port is this plus the job id modulo 1000 (jobs sharing a head node differ)
BASE_PORT = 29400
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    nproc_per_node: int
    gpus_per_node: int = 0
    partition: str = ""
    time: str = ""
    account: str = ""
    requeue: bool = False
    rdzv_port: int = 0  # 0: BASE_PORT + job id % 1000


def require(*commands: str) -> None:
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        raise UserError(f"Slurm command{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                        "not found on this machine's PATH. Run `shardwise launch --slurm` on a "
                        "login node of the cluster (or load its Slurm module), or use --dry-run "
                        "to write the batch script only.")


def time_limit_s(text: str) -> int:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    match = _TIME.match(text.strip())
    if not match:
        raise UserError(f"--time {show(text, 40)} is not a Slurm time limit; write minutes "
                        "(90), HH:MM:SS (01:30:00) or D-HH:MM:SS (1-12:00:00).")
    days, a, b, c = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # MM[:SS]


def advance_signal(spec: RunSpec) -> str:
    """The signal Slurm sends before the time limit: SIGUSR1 when it is a preemption signal
    (SIGTERM is what Slurm sends at the limit itself), else the first one; "" for none."""
    signals = [s.name for s in parse_signals(spec.failure.preempt_signals)]
    if not signals:
        return ""
    return "USR1" if "SIGUSR1" in signals else signals[0].removeprefix("SIG")


def check_job(spec: RunSpec, job: SlurmJob) -> None:
    torchrun.check_counts(job.nodes, job.nproc_per_node)
    if job.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node {job.gpus_per_node} cannot be negative.")
    grace = round(spec.failure.preempt_grace_s)
    if job.time and advance_signal(spec) and time_limit_s(job.time) <= grace:
        raise UserError(f"--time {job.time} is not longer than failure.preempt_grace_s = "
                        f"{grace} s, so the preemption signal would come before training starts. "
                        "Give a longer --time or a shorter grace period.")


def check_partition(partition: str) -> None:
    """Ask sinfo which partitions exist (before anything is written or submitted)."""
    if not partition or shutil.which("sinfo") is None:
        return
    out = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return  # sbatch will say what is wrong
    known = sorted(set(out.stdout.split()))
    if partition not in known:
        raise UserError(f"--partition {show(partition, 40)} is not a partition of this cluster "
                        f"(sinfo lists {', '.join(known) or 'none'}). Pick one of those, or leave "
                        "--partition out for the default partition.")


def render_script(spec: RunSpec, run_dir: Path, job: SlurmJob, workdir: Path) -> str:
    """The sbatch script: directives, the rendezvous host, one torchrun per node, and the exit
    code 75 (with a requeue when asked) after a preemption."""
    run = shlex.quote(str(run_dir))
    # whole nodes: one task runs every worker of its node, which a per-task CPU share (task/
    # cgroup confines a task to its CPUs) would squeeze onto one core
    directives = [f"--job-name={spec.run.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
                  "--exclusive",
                  f"--output={run_dir}/slurm-%j.out", "--open-mode=append", f"--chdir={workdir}",
                  "--requeue" if job.requeue else "--no-requeue"]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    directives += [f"--{name}={value}" for name, value in
                   (("partition", job.partition), ("time", job.time), ("account", job.account))
                   if value]
    signal_name = advance_signal(spec)
    if signal_name:
        directives.append(f"--signal={signal_name}@{round(spec.failure.preempt_grace_s)}")
    # each task decides is_host itself: node 0 of the step is the first node of the
    # allocation, $HEAD, where the rendezvous endpoint is
    args = torchrun.torchrun_args(spec, nnodes=job.nodes, nproc_per_node=job.nproc_per_node,
                                  endpoint="$HEAD:$PORT", rdzv_id="shardwise-$SLURM_JOB_ID",
                                  is_host="$IS_HOST", agent=torchrun.node_agent("$RUN_DIR"))
    launcher = " ".join(shlex.quote(a) if "$" not in a else f'"{a}"' for a in args)
    node = (f'if [ "$SLURM_NODEID" = 0 ]; then IS_HOST=true; else IS_HOST=false; fi; '
            f'exec {launcher} -m shardwise train "$@"')
    port = str(job.rdzv_port) if job.rdzv_port else f"$(({BASE_PORT} + SLURM_JOB_ID % 1000))"
    requeue = ('    scontrol requeue "$SLURM_JOB_ID"\n' if job.requeue else "")
    return "\n".join([
        "#!/bin/bash",
        "# written by `shardwise launch --slurm`; submit with sbatch (a requeued job resumes)",
        *(f"#SBATCH {d}" for d in directives),
        "set -uo pipefail",
        f"RUN_DIR={run}",
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"PORT={port}",
        "export RUN_DIR HEAD PORT  # read by every node's task",
        f'rm -f "$RUN_DIR/{MARKER}" "$RUN_DIR/{LOST_MARKER}"  # written anew by this run',
        'if [ -f "$RUN_DIR/spec.toml" ]; then TRAIN=(--resume "$RUN_DIR")',
        f'else TRAIN=("$RUN_DIR/{torchrun.JOB_SPEC}"); fi',
        f'srun --nodes={job.nodes} --ntasks={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 \\',
        f'    bash -c {shlex.quote(node)} shardwise-node "${{TRAIN[@]}}"',
        "rc=$?",
        f'if [ -f "$RUN_DIR/{MARKER}" ]; then',
        '    echo "shardwise: preempted; the checkpoint is committed and the run resumes when the'
        ' job runs again (exit code ' f'{PREEMPTED_EXIT})" >&2',
        requeue + f"    exit {PREEMPTED_EXIT}",
        "fi",
        f'if [ -f "$RUN_DIR/{LOST_MARKER}" ]; then',
        '    echo "shardwise: the node hosting the rendezvous store was lost; the run resumes from'
        ' its newest checkpoint when the job runs again (exit code ' f'{RESUMABLE_EXIT})" >&2',
        requeue + f"    exit {RESUMABLE_EXIT}",
        "fi",
        'exit "$rc"',
        "",
    ])


def submit(script: Path) -> str:
    """sbatch the script; the job id. A refusal becomes a UserError quoting sbatch."""
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        reason = " ".join((out.stderr or out.stdout).split()) or f"exit code {out.returncode}"
        raise UserError(f"sbatch refused the job: {reason}. Nothing was submitted; fix the "
                        "option it names (--partition, --account, --time, --gpus-per-node) and "
                        "launch again.")
    return out.stdout.strip().split(";")[0]


def record(run_dir: Path, job_id: str, script: Path) -> None:
    (run_dir / JOB_RECORD).write_text(json.dumps({"job_id": job_id, "script": str(script)}))


def recorded_job(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / JOB_RECORD).read_text())["job_id"])
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return None


def job_state(job_id: str) -> str:
    """The job's state from squeue (while queued or running), else sacct (after it ended, where
    accounting is configured); a note when neither knows."""
    if shutil.which("squeue") is not None:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    if shutil.which("scontrol") is not None:  # a finished job, for MinJobAge seconds
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                             text=True, timeout=30)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        if out.returncode == 0 and "JobState" in fields:
            code = fields.get("ExitCode", "")
            return f"{fields['JobState']} (exit code {code})" if code else fields["JobState"]
    if shutil.which("sacct") is not None:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            state, _, code = out.stdout.splitlines()[-1].partition("|")
            return f"{state} (exit code {code})" if code else state
    if shutil.which("squeue") is None:
        return "unknown (no Slurm commands on this machine)"
    return "ended (squeue no longer lists it; sacct has no record: accounting is not configured)"
