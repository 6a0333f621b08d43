"""Optional MLflow sink (`telemetry.mlflow = true`): params, per-step metrics, artifacts.

mlflow is not a dependency; `require_mlflow` fails at startup with what to do when it is missing.
Where runs go is MLflow's own business: `MLFLOW_TRACKING_URI` (and `MLFLOW_EXPERIMENT_NAME`, else
the experiment is the spec's `run.name`). One shardwise run is one MLflow run: its id is kept in
`RUN_DIR/mlflow.json` (with the tracking URI, credentials redacted: put them in
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD), so a resume or an elastic restart continues
the same curves.

Logging is telemetry, not training: after startup, an MLflow failure (server gone, disk full) is
one warning and the sink turns itself off; the run goes on.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from shardwise.errors import UserError
from shardwise.utils.redact import redact

RUN_FILE = "mlflow.json"
PARAM_MAX = 500  # MLflow's historical limit on a param value's length
_SKIP = frozenset({"kind", "run_id", "rank", "step", "time"})


def require_mlflow() -> ModuleType:
    try:
        import mlflow
    except ImportError as err:
        raise UserError(
            f"telemetry.mlflow is true but mlflow cannot be imported ({err}). Install it with "
            "`pip install mlflow` (or the lighter `pip install mlflow-skinny`), or turn the sink "
            "off with --set telemetry.mlflow=false.") from None
    return mlflow


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """`{"optimizer": {"lr": 0.01}}` -> `{"optimizer.lr": "0.01"}`, values cut to PARAM_MAX."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: str(tree)[:PARAM_MAX]}


class MlflowSink:
    def __init__(self, spec_dict: dict[str, Any], run_dir: Path, experiment: str) -> None:
        self._mlflow: ModuleType | None = require_mlflow()
        self.run_dir = run_dir
        self._checkpoint: str | None = None
        self._ended = False
        self._call("start the MLflow run", self._start, spec_dict, experiment)

    def _start(self, spec_dict: dict[str, Any], experiment: str) -> None:
        mlflow = self._mlflow
        assert mlflow is not None
        uri = redact(str(mlflow.get_tracking_uri()))  # often https://USER:PASSWORD@host
        if not os.environ.get("MLFLOW_EXPERIMENT_NAME") and not os.environ.get("MLFLOW_EXPERIMENT_ID"):
            mlflow.set_experiment(experiment)
        earlier = self._earlier_run(uri)
        if earlier:  # a resume or restart: continue the same MLflow run, whose params are set
            mlflow.start_run(run_id=earlier)
            return
        active = mlflow.start_run(run_name=self.run_dir.name)
        (self.run_dir / RUN_FILE).write_text(json.dumps(
            {"run_id": active.info.run_id, "tracking_uri": uri}) + "\n")
        mlflow.log_params(flatten(spec_dict))
        mlflow.set_tag("shardwise.run_dir", str(self.run_dir.resolve()))

    def _earlier_run(self, uri: str) -> str | None:
        try:
            saved = json.loads((self.run_dir / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None
        return saved.get("run_id") if saved.get("tracking_uri") == uri else None

    def write(self, event: dict[str, Any]) -> None:
        if self._mlflow is None:
            return
        kind = str(event.get("kind"))
        if kind == "checkpoint" and event.get("path"):
            self._checkpoint = str(event["path"])
        if kind == "run_end":
            self._ended = True
        metrics = {f"{kind}/{key}": float(value) for key, value in event.items()
                   if key not in _SKIP and isinstance(value, int | float)
                   and not isinstance(value, bool) and math.isfinite(value)}
        if metrics and isinstance(event.get("step"), int):
            mlflow = self._mlflow
            self._call("log metrics", lambda: mlflow.log_metrics(metrics, step=event["step"]))

    def close(self) -> None:
        if self._mlflow is None:
            return
        mlflow = self._mlflow
        manifest = self.run_dir / "manifest.json"
        if manifest.is_file():
            self._call("log the manifest", lambda: mlflow.log_artifact(str(manifest)))
        if self._checkpoint:
            path = self._checkpoint
            self._call("log the final checkpoint path", lambda: (
                mlflow.set_tag("shardwise.final_checkpoint", path),
                mlflow.log_text(path + "\n", "final_checkpoint.txt")))
        status = "FINISHED" if self._ended else "FAILED"
        self._call("end the MLflow run", lambda: mlflow.end_run(status=status))
        self._mlflow = None

    def _call(self, what: str, fn: Any, *args: Any) -> None:
        if self._mlflow is None:
            return
        try:
            fn(*args)
        except Exception as err:  # any MLflow failure: warn once, stop logging, keep training
            print(redact(f"warning: MLflow logging is off for the rest of this run: could not "
                         f"{what} ({type(err).__name__}: {err})."), file=sys.stderr)
            self._mlflow = None
