"""#26 "tracebacks still reachable", through the CLI as a user runs it: each refusal is exit 2 and
one paragraph on stderr (no traceback, no secret), before a run directory or a worker exists.
The checks themselves: tests/unit/test_spec_refusals.py and tests/unit/test_model_refusals.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import write_toml
from tests.support.specs import tiny_spec_dict

SECRET = "s3cr3tV4lue"
CUSTOM_LM = "py:examples/custom_lm.py:build"


@pytest.mark.parametrize(("family", "sets", "needle"), [
    ("gpt", ['failure.preempt_signals="SIGTERM,SIGCHLD"'], "SIGCHLD is not a preemption signal"),
    ("gpt", ["parallel.timeout_s=1e14"], "it can be at most 604800 (7 days)"),
    ("gpt", ['checkpoint.uri="s3://bucket/run"',
             f'checkpoint.endpoint_url="http://AKIAKEY:{SECRET}@minio:9000"'],
     "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"),
    (CUSTOM_LM, ["model.args={width = -1, depth = 2, heads = 4}"],
     "the builder failed with RuntimeError"),
    ("hf", ['model.hf_config={model_type = "llama", hidden_size = 64, num_hidden_layers = 2, '
            'num_attention_heads = 0}'], "num_attention_heads = 0"),
    ("hf", ['model.hf_config={model_type = "nosuchmodel"}'], "is not a model transformers"),
], ids=["sigchld", "timeout", "endpoint-secret", "builder", "hf-heads", "hf-model-type"])
def test_the_cli_refuses_in_one_paragraph(family, sets, needle, small_corpus, tmp_path,
                                          monkeypatch, capsys):
    """Each of these was a traceback (from the launcher or every worker); now exit 2, one
    paragraph on stderr, no secret in it, and no run directory made."""
    from shardwise.cli.main import main

    if family == "hf":
        pytest.importorskip("transformers")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the builder's path is relative
    config = write_toml(tmp_path / "job.toml", tiny_spec_dict(
        small_corpus, tmp_path / "run", **({} if family == "gpt" else {"model": {"family": family}})))
    assert main(["train", str(config), *[a for s in sets for a in ("--set", s)]]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and needle in " ".join(err.split())
    assert "Traceback" not in err and SECRET not in err
    assert not (tmp_path / "run").exists()
