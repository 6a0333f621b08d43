"""What `shardwise status RUN_DIR` reports: the Slurm job's state (when the run was submitted
through `shardwise launch --slurm`) and the last step, loss and throughput from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.cluster import slurm
from shardwise.errors import UserError
from shardwise.resilience.preempt import read_marker


def last_events(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The newest event of each kind (a line cut short by a running writer is skipped)."""
    latest: dict[str, dict[str, Any]] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return latest
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        latest[event.get("kind", "")] = event
    return latest


def report(run_dir: Path) -> str:
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory. Pass the run directory that `shardwise "
                        "train` or `shardwise launch` printed.")
    lines = [f"run: {run_dir}"]
    job_id = slurm.recorded_job(run_dir)
    if job_id is not None:
        lines.append(f"slurm job {job_id}: {slurm.job_state(job_id)}")
    events = last_events(run_dir)
    step = events.get("step")
    if step is None:
        lines.append("no step logged yet (metrics.jsonl has none)")
    else:
        rate = step.get("tokens_per_s")
        lines.append(f"last step {step['step']}: loss {step['loss']:.4f}"
                     + (f", {rate:,.0f} tokens/s" if rate is not None else "")
                     + (f", {step['samples_per_s']:.2f} samples/s"
                        if step.get("samples_per_s") is not None else ""))
    newest = _newest_checkpoint(run_dir)
    if newest is not None:
        lines.append(f"newest checkpoint: {newest}")
    marker = read_marker(run_dir)
    if marker is not None:
        when = "during start-up" if marker.get("step") is None else f"after step {marker['step']}"
        saved = f"checkpoint {Path(marker['checkpoint']).name}" if marker.get("checkpoint") \
            else "no checkpoint saved"
        lines.append(f"preempted by {marker['signal']} {when} ({saved}); it resumes when "
                     "relaunched")
    elif "run_end" in events:
        lines.append(f"finished at step {events['run_end']['step']}")
    return "\n".join(lines)


def _newest_checkpoint(run_dir: Path) -> str | None:
    """The newest complete checkpoint (sizes checked, not hashed), wherever the run keeps them."""
    if not (run_dir / "checkpoints").is_dir():
        return None
    from shardwise.checkpoint.discovery import newest_complete, run_checkpoints

    try:
        found = newest_complete(run_checkpoints(run_dir))
    except UserError as err:  # an unreachable bucket must not hide the rest of the report
        return f"unknown ({err})"
    return None if found is None else str(found)
