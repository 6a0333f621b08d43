"""The run manifest (what reproduces a run) and `shardwise inspect`."""

from __future__ import annotations

import hashlib
import json

import torch

from shardwise.cli.main import main
from shardwise.data import prepare_data
from shardwise.run.preflight import with_data_hashes
from tests.support.specs import tiny_spec
from tests.support.workers import train_single


def test_manifest_records_the_run_and_its_lineage(small_corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = tiny_spec(small_corpus, run_dir, run={"steps": 4, "stop_at": 2},
                      checkpoint={"enabled": True})
    train_single(first)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    data = prepare_data(first.data)
    # the spec the run trained: the data's hashes pinned in (as the launcher pins them)
    assert manifest["spec_sha256"] == with_data_hashes(first, data).digest() != first.digest()
    assert manifest["spec"]["run"]["seed"] == first.run.seed == manifest["seed"]
    assert manifest["data"]["content_sha256"] == data.content_hash
    assert manifest["data"]["tokenizer_sha256"] == data.tokenizer_hash
    assert manifest["environment"]["torch"] == torch.__version__
    assert len(manifest["environment"]["packages_sha256"]) == 64
    assert manifest["topology"]["world_size"] == 1 and manifest["topology"]["layout"] == "single"
    assert manifest["lineage"] == []
    checkpoint = run_dir / "checkpoints" / "step-000002"
    assert json.loads((checkpoint / "manifest.json").read_text()) == manifest

    resumed = tiny_spec(small_corpus, run_dir, run={"steps": 4}, checkpoint={"enabled": True})
    train_single(resumed, resume=True)
    after = json.loads((run_dir / "manifest.json").read_text())
    (entry,) = after["lineage"]
    assert entry["resumed_from"] == str(checkpoint) and entry["step"] == 2
    assert entry["manifest_sha256"] == hashlib.sha256(
        (checkpoint / "manifest.json").read_bytes()).hexdigest()
    # the newest checkpoint carries the lineage forward
    final = json.loads((run_dir / "checkpoints" / "step-000004" / "manifest.json").read_text())
    assert final["lineage"] == after["lineage"]

    assert main(["inspect", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step-000002" in out
    assert with_data_hashes(resumed, data).digest()[:16] in out
    recorded = json.loads((run_dir / "manifest.json").read_text())["environment"]["container"]
    shown = f"{recorded['image'] or 'unnamed image'} ({recorded['runtime']})" if recorded \
        else "none (not in a container)"  # the CI machines are Docker containers
    assert f"container      {shown}" in out
    assert main(["inspect", str(checkpoint), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == manifest
    assert main(["inspect", str(checkpoint), str(run_dir), "--json"]) == 0
    changed = json.loads(capsys.readouterr().out)
    assert changed["spec.run.stop_at"] == {"a": 2, "b": 0}
    assert "lineage" in changed and "seed" not in changed


def test_inspect_refuses_a_path_that_is_not_a_run(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "not a run or checkpoint directory" in err
    (tmp_path / "manifest.json").write_text("{truncated")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a valid manifest" in capsys.readouterr().err
