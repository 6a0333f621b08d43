"""The run's lifecycle through the real CLI (in this process, one worker): train to step 2,
`register` it, train on to step 4 (retention, keep_last = 1, keeps the registered step 2), branch
back with `train --resume --from early`: the abandoned step 4 is moved aside, the branch's steps
3-4 have the losses and its step 4 the parameters of the line it replaced (same data, same seed),
the ledger audits exact with the branch marked, and `inspect --verify-chain` walks 4 -> 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardwise.checkpoint.layout import ABANDONED
from shardwise.cli.main import main
from shardwise.data.ledger import audit
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.specs import tiny_spec_dict


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def losses(run: Path) -> dict[int, list[float]]:
    found: dict[int, list[float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "step":
            found.setdefault(event["step"], []).append(event["loss"])
    return found


def params(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)["model"]


#: a tiny Llama built from its config by transformers (offline): the same commands on a
#: Hugging Face model
HF_LLAMA = {"family": "hf", "hf_config": {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}}


@pytest.mark.parametrize("model", [pytest.param(None, id="gpt"),
                                   pytest.param(HF_LLAMA, id="hf-llama", marks=pytest.mark.grid)])
def test_register_branch_and_chain(model, small_corpus, tmp_path, capsys, monkeypatch) -> None:
    run = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    data = tiny_spec_dict(small_corpus, run, run={"steps": 4, "stop_at": 2},
                          eval={"every": 2}, checkpoint={"enabled": True, "every": 2,
                                                         "keep_last": 1, "async_save": False})
    if model is not None:
        pytest.importorskip("transformers")
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        data["model"] = model
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    assert cli(capsys, "train", str(config))[0] == 0
    code, out, _ = cli(capsys, "register", str(run), "--name", "early")
    assert code == 0 and "as 'early'" in out and "held-out loss" in out
    assert cli(capsys, "train", "--resume", str(run), "--set", "run.stop_at=0")[0] == 0
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000002", "step-000004"]
    first = params(ckpts / "step-000004", tmp_path / "first.pt")

    code, _, err = cli(capsys, "train", "--resume", str(run), "--from", "early")
    assert code == 0 and "are moved to" in err
    (aside,) = (ckpts / ABANDONED).iterdir()
    assert [p.name for p in aside.iterdir()] == ["step-000004"]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-000002", "step-000004"]
    again = params(ckpts / "step-000004", tmp_path / "again.pt")
    assert first.keys() == again.keys()
    for name in first:  # one process, same data and seed: the same numbers
        assert torch.equal(first[name], again[name]), name
    for step in range(3, 5):
        old, new = losses(run)[step]
        assert old == new, step

    launches = [json.loads(x) for x in (run / "ledger" / "launches.jsonl").read_text().splitlines()]
    assert launches[-1]["start_step"] == 2 and launches[-1]["branch"]["name"] == "early"
    assert launches[-1]["branch"]["abandoned_steps"] == [4]
    assert audit(run).exact
    lineage = json.loads((run / "manifest.json").read_text())["lineage"]
    assert lineage[-1]["step"] == 2 and lineage[-1]["branch"]["from_step"] == 2

    code, out, _ = cli(capsys, "inspect", "--verify-chain", str(run))
    assert code == 0 and "step-000004" in out and "chain: OK (1 link checked" in out
    code, out, _ = cli(capsys, "registry", str(run))
    assert code == 0 and "early" in out
