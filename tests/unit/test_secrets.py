"""#26 item 14: credentials redacted wherever shardwise writes or prints a URI it did not get from
the spec (which refuses them: tests/unit/test_spec_refusals.py): location.json, mlflow.json,
metrics.jsonl, messages."""

from __future__ import annotations

import json
import sys
import types

import pytest

from shardwise.utils.redact import has_credentials, redact

SECRET = "s3cr3tV4lue"


@pytest.mark.parametrize(("text", "want"), [
    (f"http://AKIAKEY:{SECRET}@minio:9000", "http://***@minio:9000"),
    (f"https://{SECRET}@github.com/org/repo", "https://***@github.com/org/repo"),
    (f"https://user:p@ss{SECRET}@host/x", "https://***@host/x"),  # an unescaped @ in a password
    (f"failed: (https://u:{SECRET}@h) and s3://b/p", "failed: (https://***@h) and s3://b/p"),
    (f"https://h/o?X-Amz-Signature={SECRET}&X-Amz-Credential=K/2026&n=1#f",
     "https://h/o?X-Amz-Signature=***&X-Amz-Credential=***&n=1#f"),
    (f"https://h/api?token={SECRET}", "https://h/api?token=***"),
])
def test_redact_masks_userinfo_and_secret_parameters(text, want):
    assert redact(text) == want
    assert SECRET not in redact(text) and has_credentials(text)
    assert redact(want) == want and not has_credentials(want)  # idempotent


@pytest.mark.parametrize("text", [
    "http://minio:9000", "s3://bucket/prefix", "https://registry.example/@scope/pkg",
    "https://h/p?monkey=1&keyword=2", "user:pass@host (no scheme: not a URI)", "ROMEO:",
    "databricks://profile", "file:///fake", "https://h/?token=",
])
def test_redact_leaves_uris_without_credentials_alone(text):
    assert redact(text) == text and not has_credentials(text)


def test_location_json_never_holds_credentials(tmp_path):
    """location.json is written from a StorageSpec; one made with credentials outside the
    RunSpec (an old run, the Python API) has them redacted."""
    from shardwise.checkpoint.location import StorageSpec
    from shardwise.checkpoint.storage import LOCATION_FILE, open_storage, record_location

    elsewhere = tmp_path / "elsewhere"
    spec = StorageSpec(str(elsewhere), f"http://AKIAKEY:{SECRET}@minio:9000")
    assert spec.record()["endpoint_url"] == "http://***@minio:9000"
    local = tmp_path / "run" / "checkpoints"
    local.mkdir(parents=True)
    record_location(spec, open_storage(StorageSpec(str(elsewhere)), local), local)
    written = (local / LOCATION_FILE).read_text()
    assert SECRET not in written and json.loads(written)["uri"] == str(elsewhere)


FAKE_MLFLOW = f'''
from types import SimpleNamespace
RUNS = []
def get_tracking_uri():
    return "https://alice:{SECRET}@mlflow.example:5000"
def set_experiment(name): pass
def start_run(run_id=None, run_name=None):
    RUNS.append(run_id or "r1")
    return SimpleNamespace(info=SimpleNamespace(run_id=RUNS[-1]))
def log_params(params): pass
def set_tag(key, value): pass
def log_metrics(metrics, step=None):
    raise ConnectionError("cannot reach " + get_tracking_uri() + "/api/2.0/mlflow/runs/log-batch")
def end_run(status="FINISHED"): pass
'''


def test_mlflow_json_and_warnings_redact_the_tracking_uri(tmp_path, monkeypatch, capsys):
    """The tracking URI (user:password@ is common) is written to RUN_DIR/mlflow.json and quoted
    by MLflow's errors; a second launch still finds its run by the redacted URI."""
    from shardwise.telemetry.mlflow_sink import RUN_FILE, MlflowSink

    module = types.ModuleType("mlflow")
    exec(compile(FAKE_MLFLOW, "fake_mlflow", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "mlflow", module)
    sink = MlflowSink({"run": {"steps": 1}}, tmp_path, "exp")
    saved = (tmp_path / RUN_FILE).read_text()
    assert SECRET not in saved
    assert json.loads(saved)["tracking_uri"] == "https://***@mlflow.example:5000"
    sink.write({"kind": "step", "step": 1, "loss": 2.0})
    warning = capsys.readouterr().err
    assert "MLflow logging is off" in warning and "https://***@mlflow.example" in warning
    assert SECRET not in warning
    MlflowSink({"run": {"steps": 1}}, tmp_path, "exp")  # a resume continues the same run
    assert module.RUNS == ["r1", "r1"]


def test_metrics_jsonl_redacts_uris_in_events(tmp_path):
    from shardwise.telemetry.events import JsonlSink

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write({"kind": "warning", "step": 3,
                "message": f"upload to https://k:{SECRET}@minio:9000 failed",
                "detail": {"endpoint": f"http://k:{SECRET}@h"}, "loss": float("nan")})
    sink.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert SECRET not in text
    event = json.loads(text)
    assert event["message"] == "upload to https://***@minio:9000 failed"
    assert event["detail"] == {"endpoint": "http://***@h"} and event["loss"] == "nan"


def test_s3_messages_redact_an_endpoint_from_the_environment(monkeypatch):
    """$AWS_ENDPOINT_URL is not the spec's to refuse: the message about an unreachable endpoint
    quotes it, and botocore's own text, redacted (s3fs stands in: no network here)."""
    from shardwise.checkpoint.location import StorageSpec
    from shardwise.checkpoint.object_storage import open_s3
    from shardwise.errors import UserError

    class S3FileSystem:
        def __init__(self, **options):
            self.endpoint = options["endpoint_url"]

        def call_s3(self, *args, **kwargs):
            raise ConnectionError(f'Could not connect to the endpoint URL: "{self.endpoint}/bucket"')

    monkeypatch.setitem(sys.modules, "s3fs", types.SimpleNamespace(S3FileSystem=S3FileSystem))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://AKIAKEY:{SECRET}@127.0.0.1:9")
    with pytest.raises(UserError) as caught:
        open_s3("s3://bucket/run", StorageSpec("s3://bucket/run"))
    message = str(caught.value)
    assert "cannot reach the S3 endpoint http://***@127.0.0.1:9" in message
    assert SECRET not in message
