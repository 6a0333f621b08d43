"""`shardwise export`: a checkpoint written by a sharded layout becomes one safetensors file whose
tensors equal the run's gathered parameters, loadable without pickle."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from shardwise.cli.main import main
from shardwise.run.export import load_exported
from tests.support.cli import write_toml
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec, tiny_spec_dict
from tests.support.workers import train


@pytest.mark.parametrize(("layout", "world", "parallel", "model"), [
    ("zero3-2", 2, {"dp_shard": 2}, {}),
    pytest.param("tp2", 2, {"tp": 2, "dp_shard": 1}, {"tie_embeddings": False},
                 marks=pytest.mark.grid),
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


def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(200)
def test_export_refuses_to_write_over_its_source(small_corpus, tmp_path, capsys):
    """`shardwise export RUN --out DIR` with DIR the run's model.hf_path (before: the weights
    fine-tuning started from were replaced, then the export crashed), inside it, or inside the
    checkpoint being read: exit 2 before anything is written; both stay byte for byte."""
    transformers = pytest.importorskip("transformers")
    from shardwise.data import prepare_data

    source = tmp_path / "pretrained"
    data = prepare_data(tiny_spec(small_corpus, tmp_path / "unused").data)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        vocab_size=data.vocab_size)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(source))
    (source / "tokenizer.json").write_bytes(Path(data.tokenizer_path).read_bytes())
    spec = tiny_spec_dict(small_corpus, tmp_path / "run", run={"steps": 1},
                          checkpoint={"enabled": True}, eval={"every": 0, "batches": 1})
    spec["model"] = {"family": "hf", "hf_path": str(source)}
    assert main(["train", str(write_toml(tmp_path / "job.toml", spec))]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    before = (_tree_digest(source), _tree_digest(checkpoint))
    capsys.readouterr()
    for out, fmt, what in [(source, "hf", "model.hf_path"), (source / "x", "safetensors",
                                                             "model.hf_path"),
                           (checkpoint / "export", "hf", "the checkpoint being exported")]:
        assert main(["export", str(tmp_path / "run"), "--format", fmt, "--out", str(out)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"the export folder {out} is {what}" in err and "would overwrite" in err
        assert (_tree_digest(source), _tree_digest(checkpoint)) == before
    assert not (source / "x").exists() and not (checkpoint / "export").exists()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out",
                 str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "model.safetensors").is_file()
