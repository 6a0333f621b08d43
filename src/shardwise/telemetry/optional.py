"""The sinks a spec may turn on beyond metrics.jsonl: Prometheus and MLflow (neither a dependency).

`check_optional_sinks` runs on every rank, so a missing package stops all ranks with the same
message instead of rank 0 alone while the others wait for it at their first collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.spec.operations import TelemetrySection
from shardwise.telemetry.events import Sink


def check_optional_sinks(telemetry: TelemetrySection) -> None:
    if telemetry.mlflow:
        from shardwise.telemetry.mlflow_sink import require_mlflow

        require_mlflow()


def optional_sinks(t: TelemetrySection, run_dir: Path, run_name: str,
                   params: dict[str, Any]) -> list[Sink]:
    """Rank 0's extra sinks, as the `telemetry` section asks; `params` (the whole spec as a
    dict) is what MLflow records as the run's parameters."""
    sinks: list[Sink] = []
    if t.prometheus_port > 0:
        from shardwise.telemetry.prometheus import start_prometheus

        server = start_prometheus(t.prometheus_host, t.prometheus_port)
        if server is not None:
            sinks.append(server)
    if t.mlflow:
        from shardwise.telemetry.mlflow_sink import MlflowSink

        sinks.append(MlflowSink(params, run_dir, experiment=run_name))
    return sinks
