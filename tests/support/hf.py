"""Hugging Face round trips shared by the HF tests (needs transformers)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.support.cli import shardwise


def export_round_trip(run_dir: Path, spec, params: dict, out: Path) -> torch.nn.Module:
    """`shardwise export --format hf` of the run's last checkpoint, loaded back by transformers:
    the trained parameters exactly, and the trained model's logits exactly. The loaded model."""
    from shardwise.checkpoint.discovery import checkpoint_at
    from shardwise.run.export import consolidated

    proc = shardwise("export", str(run_dir), "--format", "hf", "--out", str(out), cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, params[name]), name
    trained, _, _ = consolidated(checkpoint_at(run_dir), spec)
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, trained(tokens))
    return loaded
