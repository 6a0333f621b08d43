"""#26: spec values that reached the user as a traceback, or as damage, before any refusal: a
signal that is no preemption (SIGCHLD: every launch "preempted" by the `git` subprocess), a
collective timeout no time span holds (an OverflowError in every worker), an HF export into the
weights the run starts from, credentials in a URI (copied into spec.toml, every checkpoint's
manifest, the MLflow parameters). Each is now one paragraph (SpecError: exit 2) from the spec
itself, before any worker starts."""

from __future__ import annotations

import signal

import pytest

from shardwise.errors import SpecError
from shardwise.spec import load_spec
from shardwise.spec.failure import parse_signals


def _one_paragraph(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message and len(message) < 700, message


# --- failure.preempt_signals ------------------------------------------------------------------
@pytest.mark.parametrize(("name", "why"), [
    ("SIGCHLD", "child process (such as `git`) exits"), ("PIPE", "reasons of its own"),
    ("SIGSEGV", "reports a crash"), ("WINCH", "reasons of its own")])
def test_signals_that_are_not_preemptions_are_refused(name, why):
    """Before: SIGCHLD was accepted, and the `git` subprocess of the manifest then 'preempted'
    every launch."""
    with pytest.raises(SpecError) as caught:
        load_spec(None, [f'failure.preempt_signals="SIGTERM,{name}"'])
    message = str(caught.value)
    assert "is not a preemption signal" in message and why in message
    assert "SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGXCPU" in message
    _one_paragraph(message)
    with pytest.raises(SpecError, match="not a preemption signal"):
        load_spec(None, [f'failure.faults="signal:rank=0:step=2:sig={name}"'])


def test_what_schedulers_send_is_accepted():
    assert parse_signals("TERM, usr1, SIGUSR2, XCPU, HUP, INT, QUIT, ALRM") == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGXCPU, signal.SIGHUP,
        signal.SIGINT, signal.SIGQUIT, signal.SIGALRM)


# --- parallel.timeout_s -----------------------------------------------------------------------
def test_a_collective_timeout_beyond_a_week_is_refused():
    """Before: 1e14 passed validation, and every worker died on an OverflowError from
    timedelta."""
    with pytest.raises(SpecError) as caught:
        load_spec(None, ["parallel.timeout_s=1e14"])
    assert "parallel.timeout_s is 1e+14 seconds; it can be at most 604800 (7 days)" in str(
        caught.value)
    _one_paragraph(str(caught.value))
    assert load_spec(None, ["parallel.timeout_s=604800"]).parallel.timeout_s == 604800


# --- checkpoint.hf_export into model.hf_path --------------------------------------------------
@pytest.mark.parametrize("inside", ["", "sub"])
def test_hf_export_into_the_source_weights_is_refused(tmp_path, inside):
    source = tmp_path / "pretrained"
    source.mkdir()
    target = source / inside if inside else source
    with pytest.raises(SpecError, match="would overwrite the weights this run starts from"):
        load_spec(None, ['model.family="hf"', f'model.hf_path="{source}"',
                         f'checkpoint.hf_export="{target}"'])
    with pytest.raises(SpecError, match="would overwrite"):  # relative: inside run.dir
        load_spec(None, ['model.family="hf"', f'model.hf_path="{source}"',
                         f'run.dir="{tmp_path}"', 'checkpoint.hf_export="pretrained"'])
    spec = load_spec(None, ['model.family="hf"', f'model.hf_path="{source}"',
                            f'checkpoint.hf_export="{tmp_path / "out"}"'])
    assert spec.checkpoint.hf_export == str(tmp_path / "out")


# --- credentials in the spec -------------------------------------------------------------------
SECRET = "s3cr3tV4lue"


@pytest.mark.parametrize(("overrides", "field", "names"), [
    (['checkpoint.uri="s3://bucket/run"',
      f'checkpoint.endpoint_url="http://AKIAKEY:{SECRET}@minio:9000"'],
     "checkpoint.endpoint_url", ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "checkpoint.profile")),
    # before: the bucket check's own message quoted the whole URI, secret included
    ([f'checkpoint.uri="s3://AKIAKEY:{SECRET}@bucket/run"'],
     "checkpoint.uri", ("AWS_ACCESS_KEY_ID", "checkpoint.profile")),
    (['model.family="py:models/mlp.py:build"',
      f'model.args={{weights = "https://hub.example/w.bin?token={SECRET}"}}'],
     "model.args.weights", ("MLFLOW_TRACKING_USERNAME", "HF_TOKEN")),
    ([f'data.source="https://alice:{SECRET}@data.example/corpus.txt"'],
     "data.source", ("MLFLOW_TRACKING_PASSWORD",)),
])
def test_the_spec_refuses_credentials_in_any_field(overrides, field, names):
    """Before: accepted, then copied into spec.toml, every checkpoint's manifest,
    location.json, the MLflow parameters and error messages."""
    with pytest.raises(SpecError) as caught:
        load_spec(None, overrides)
    message = str(caught.value)
    assert message.startswith(f"{field} = ") and "carries credentials" in message
    assert SECRET not in message and "***" in message
    for name in names:
        assert name in message


def test_the_spec_still_takes_endpoints_and_profiles_without_secrets():
    spec = load_spec(None, ['checkpoint.uri="s3://bucket/run"',
                            'checkpoint.endpoint_url="http://minio:9000"',
                            'checkpoint.profile="team"'])
    assert spec.checkpoint.endpoint_url == "http://minio:9000"
