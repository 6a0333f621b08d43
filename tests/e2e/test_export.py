"""`shardwise export`: a checkpoint written by a sharded layout becomes one safetensors file whose
tensors equal the run's gathered parameters, loadable without pickle."""

from __future__ import annotations

import pytest
import torch

from shardwise.cli.main import main
from shardwise.run.export import load_exported
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train


@pytest.mark.parametrize(("layout", "world", "parallel", "model"), [
    ("zero3-2", 2, {"dp_shard": 2}, {}),
    ("tp2", 2, {"tp": 2, "dp_shard": 1}, {"tie_embeddings": False}),
])
def test_export_equals_the_runs_parameters(layout, world, parallel, model, small_corpus, tmp_path,
                                           capsys):
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 2}, model=model,
                     checkpoint={"enabled": True}, parallel={**parallel, "nproc": world})
    result = run_ranks(train, world, spec)[0]
    assert main(["export", str(run_dir / "checkpoints" / "step-000002")]) == 0
    model_file = run_dir / "export" / "step-000002" / "model.safetensors"
    assert str(model_file) in capsys.readouterr().out
    exported, config = load_exported(model_file)
    assert config["step"] == 2
    exported_state = exported.state_dict()
    assert result["params"].keys() <= exported_state.keys()
    for name, value in result["params"].items():
        assert torch.equal(exported_state[name], value), name
    assert (model_file.parent / "tokenizer.json").is_file()


def test_export_refuses_a_damaged_or_missing_checkpoint(small_corpus, tmp_path, capsys):
    assert main(["export", str(tmp_path)]) == 2
    assert "is neither a checkpoint (no meta.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--format", "onnx"]) == 2
    assert "--format 'onnx' is not supported" in capsys.readouterr().err
