"""The tiny RunSpec every test starts from, and the grid parameter helper."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.spec import RunSpec, spec_from_dict

ROOT = Path(__file__).resolve().parents[2]
#: small fixed inputs: user model files, the golden loss curve
ASSETS = ROOT / "tests" / "assets"


def tiny_spec_dict(corpus: Path, run_dir: Path, **sections: dict) -> dict:
    """A model of ~60 K parameters on short sequences: milliseconds per step on one core."""
    spec = {
        "run": {"name": "tiny", "dir": str(run_dir), "seed": 7, "steps": 5},
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128},
        "data": {"source": str(corpus), "seq_len": 32, "vocab_size": 512, "val_fraction": 0.05},
        "batch": {"global_batch": 8, "micro_batch": 2},
        "optimizer": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2},
        "parallel": {"nproc": 1, "timeout_s": 60},
        "eval": {"every": 0, "batches": 1},
        "log": {"every": 1, "tensorboard": False, "progress": False},
        "checkpoint": {"enabled": False},
        "sample": {"tokens": 0},
    }
    if sections.get("model", {}).get("family", "gpt") not in ("gpt", "moe-gpt"):
        spec["model"] = {}  # the tiny GPT's keys belong to the GPT families (spec/model.py)
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    return spec


#: the data and eval sections of "evaluate the whole held-out split": 0.008 of the four plays
#: (tests/conftest.py's small corpus) is 59 sequences of 32 tokens, an odd count, so the last
#: micro-batch is short and data-parallel ranks get unequal shares; eval.batches is larger than
#: the split. A fifth of the default split: the DTensor layouts spent half their test time in it.
WHOLE_SPLIT_DATA = {"val_fraction": 0.008}
WHOLE_SPLIT_EVAL = {"batches": 1000}


def held_out_sequences(spec: RunSpec) -> int:
    """How many sequences the held-out split of `spec` has (prepares its data)."""
    from shardwise.data import prepare_data

    return len(prepare_data(spec.data).split("val", spec.data.seq_len))


def tiny_spec(corpus: Path, run_dir: Path, **sections: dict) -> RunSpec:
    return spec_from_dict(tiny_spec_dict(corpus, run_dir, **sections)).validate()


def grid(names, default):
    """pytest parameters for `names`, where those outside `default` carry the `grid` marker: the
    default test command runs a representative row per kind of layout, `pytest -m grid` the rest."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.grid, id=str(n)) for n in names]
