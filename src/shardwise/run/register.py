"""`shardwise register RUN_DIR [--step N] --name NAME`: a committed checkpoint as a named artifact.

The entry (see `checkpoint.registry`) pins the checkpoint by its meta.json digest and carries
what a reader of the registry wants without opening the run: the manifest's identity (run id,
spec, data and tokenizer hashes, code version, seed, layout, lineage with its branches) and the
evaluation results at that step, read back from the run's metrics.jsonl (held-out loss and
accuracy, the training loss, the target-quality fields of `run_end`). It always goes into
ROOT/registry.json — the local registry, and what protects the checkpoint from retention — and,
when mlflow is importable and a tracking URI is configured ($MLFLOW_TRACKING_URI, or the one the
run's MLflow sink recorded in RUN_DIR/mlflow.json), also into the MLflow model registry as a new
version of the model NAME whose source is the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from shardwise.checkpoint import chain, ownership, registry
from shardwise.checkpoint.discovery import run_checkpoints
from shardwise.checkpoint.integrity import verify
from shardwise.checkpoint.layout import META, step_dir_name, step_of
from shardwise.errors import UserError
from shardwise.run.branch import who
from shardwise.utils.redact import redact

MANIFEST = "manifest.json"  # a checkpoint's copy of the run manifest (run.manifest.MANIFEST)
_MANIFEST_KEYS = ("run_id", "spec_sha256", "seed", "precision")


def register(run_dir: Path, name: str, step: int | None = None) -> registry.Entry:
    """Register the checkpoint of `run_dir` at `step` (None: the newest committed) as `name`."""
    registry.check_name(name)
    if not (run_dir / "spec.toml").is_file():
        raise UserError(f"{run_dir} is not a run directory (no spec.toml in it). Pass the "
                        "directory `shardwise train` created, e.g. runs/NAME.")
    storage = run_checkpoints(run_dir)
    root = storage.root
    storage.recover()
    steps = sorted(s for p in ownership.committed(storage.step_dirs())
                   if (s := step_of(p)) is not None)
    if not steps:
        raise UserError(f"{run_dir} has no committed checkpoint to register (in {root}). Train "
                        "with checkpoint.enabled = true, or register after its first save.")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UserError(f"--step {step}: {run_dir} has no committed checkpoint at that step "
                        f"(committed: {', '.join(map(str, steps))}). Pass one of those.")
    location = root / step_dir_name(step)
    verdict = verify(location, 0, 1, False)
    if not verdict.valid:
        raise UserError(f"{location} does not verify ({'; '.join(verdict.problems[:3])}): a "
                        "damaged checkpoint is not registered. Register another step.")
    meta_text = (location / META).read_text()
    record: dict[str, Any] = {
        "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by": who(),
        "location": str(location), "run_dir": str(run_dir.resolve()),
        "manifest": manifest_summary(location), "eval": eval_results(run_dir, step)}
    mlflow_info = _mlflow_register(run_dir, name, str(location), step, record)
    if mlflow_info is not None:
        record["mlflow"] = mlflow_info
    entry = registry.Entry(name, location.name, step, chain.digest(meta_text), record)
    registry.add(root, entry)
    if not (location / META).exists():  # retention of a running launch got there first
        registry.remove(root, name)
        raise UserError(f"{location} was deleted by the run's retention while it was being "
                        "registered. Register a newer step.")
    return entry


def manifest_summary(location: Any) -> dict[str, Any]:
    """What identifies the checkpoint's run (from its copy of the manifest)."""
    try:
        text = (location / MANIFEST).read_text()
        manifest = json.loads(text)
    except (FileNotFoundError, ValueError):
        return {}
    data, code, topology = manifest.get("data", {}), manifest.get("code", {}), \
        manifest.get("topology", {})
    return {**{k: manifest.get(k) for k in _MANIFEST_KEYS},
            "manifest_sha256": chain.digest(text),
            "data_sha256": data.get("content_sha256"),
            "tokenizer_sha256": data.get("tokenizer_sha256"),
            "git_commit": code.get("git_commit"), "shardwise": code.get("shardwise"),
            "layout": topology.get("layout"), "world_size": topology.get("world_size"),
            "lineage": manifest.get("lineage", [])}


def eval_results(run_dir: Path, step: int) -> dict[str, Any]:
    """The evaluation at `step` as the run recorded it (the last record of the step counts: a
    step run again after a restart or on a branch supersedes the earlier one)."""
    found: dict[str, Any] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return found
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a line a crash cut short
        if event.get("step") != step:
            continue
        kind = event.get("kind")
        if kind == "eval":
            found.update(val_loss=event.get("val_loss"), val_accuracy=event.get("val_accuracy"),
                         eval_tokens=event.get("eval_tokens"))
        elif kind == "step":
            found.update(train_loss=event.get("loss"), tokens_seen=event.get("tokens_seen"))
        elif kind == "run_end":
            found.update({k: event.get(k) for k in ("target_loss", "target_step",
                                                    "target_tokens", "target_s")})
    return {k: v for k, v in found.items() if v is not None}


def _mlflow_register(run_dir: Path, name: str, source: str, step: int,
                     record: dict[str, Any]) -> dict[str, Any] | None:
    """A new version of the MLflow registered model `name` (None when mlflow is not importable
    or no tracking URI is configured)."""
    try:
        import mlflow
    except ImportError:
        return None
    uri, run_id = os.environ.get("MLFLOW_TRACKING_URI", ""), None
    try:
        saved = json.loads((run_dir / "mlflow.json").read_text())
        uri, run_id = uri or str(saved.get("tracking_uri", "")), saved.get("run_id")
    except (OSError, ValueError):
        pass
    if not uri:
        return None
    try:
        mlflow.set_tracking_uri(uri)
        client = mlflow.MlflowClient()
        with contextlib.suppress(Exception):  # already registered: add a version to it
            client.create_registered_model(name)
        evals = record["eval"]
        tags = {"shardwise.step": str(step), "shardwise.run_dir": record["run_dir"],
                **{f"shardwise.{k}": str(v) for k, v in evals.items()}}
        version = client.create_model_version(name, source, run_id=run_id, tags=tags)
    except Exception as err:
        raise UserError(f"the MLflow registry at {redact(uri)} refused {name!r} ({err}); "
                        "nothing was registered. Fix the tracking server or its credentials "
                        "(MLFLOW_TRACKING_USERNAME / _PASSWORD), or unset MLFLOW_TRACKING_URI "
                        "to register in the local registry file only.") from None
    return {"model": name, "version": str(getattr(version, "version", "")),
            "tracking_uri": redact(uri)}
