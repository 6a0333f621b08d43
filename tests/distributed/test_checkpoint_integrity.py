"""Verified checkpoints: a truncated shard, a flipped byte, a missing meta.json and a stale
staging directory are each detected and named, and the resume falls back to the newest checkpoint
that verifies — and then trains exactly like the uninterrupted run. Plus retention."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == kind]


@pytest.fixture(scope="module")
def uninterrupted(small_corpus, tmp_path_factory):
    return train_single(tiny_spec(small_corpus, tmp_path_factory.mktemp("full") / "run",
                                  run={"steps": 6}))


@pytest.fixture(scope="module")
def pristine(small_corpus, tmp_path_factory):
    """A run stopped at step 4 with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("pristine") / "run"
    train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6, "stop_at": 4},
                           checkpoint={"enabled": True, "every": 2}))
    return run_dir


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "needle"), [
    (lambda c: truncate(c / "__0_0.distcp"), "__0_0.distcp has"),
    (lambda c: flip(c / "__0_0.distcp"), "__0_0.distcp has the wrong SHA-256"),
    (lambda c: flip(c / "rng" / "rank-00000.pt"), "rng/rank-00000.pt has the wrong SHA-256"),
    (lambda c: (c / "meta.json").unlink(), "meta.json is missing"),
], ids=["truncated-shard", "flipped-byte", "flipped-rng", "missing-meta"])
def test_damaged_checkpoint_falls_back(damage, needle, pristine, uninterrupted, small_corpus,
                                       tmp_path, capfd):
    run_dir = tmp_path / "run"
    shutil.copytree(pristine, run_dir)
    damage(run_dir / "checkpoints" / "step-000004")
    result = train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6},
                                    checkpoint={"enabled": True, "every": 2}), resume=True)
    (rejected,) = events(run_dir, "checkpoint_rejected")
    assert rejected["path"].endswith("step-000004")
    assert any(needle in p for p in rejected["problems"]), rejected["problems"]
    assert events(run_dir, "resume")[-1]["path"].endswith("step-000002")
    err = capfd.readouterr().err
    assert "skipping checkpoint step-000004" in err and needle in err
    # steps 3..6 retrained from step 2 are the uninterrupted run's steps
    assert result["losses"] == uninterrupted["losses"][2:]


def test_stale_staging_directory_is_removed_and_named(pristine, uninterrupted, small_corpus,
                                                      tmp_path, capfd):
    run_dir = tmp_path / "run"
    shutil.copytree(pristine, run_dir)
    stale = run_dir / "checkpoints" / "step-000006.staging"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half a save")
    result = train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6},
                                    checkpoint={"enabled": True, "every": 2}), resume=True)
    assert f"removing {stale}" in capfd.readouterr().err  # claimed: nobody else writes it
    assert events(run_dir, "resume")[-1]["path"].endswith("step-000004")
    assert result["losses"] == uninterrupted["losses"][4:]
    assert (run_dir / "checkpoints" / "step-000006" / "meta.json").is_file()  # replaced


def test_nothing_valid_is_a_user_error_naming_the_files(pristine, small_corpus, tmp_path):
    from shardwise.errors import UserError

    run_dir = tmp_path / "run"
    shutil.copytree(pristine, run_dir)
    for step in ("000002", "000004"):
        flip(run_dir / "checkpoints" / f"step-{step}" / "__0_0.distcp")
    with pytest.raises(UserError, match=r"no valid checkpoint.*step-000004: __0_0\.distcp"):
        train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6}), resume=True)


@pytest.mark.grid  # 11 s
def test_parallel_verification_at_world_2(small_corpus, tmp_path):
    """Each rank hashes its share; a flipped byte in rank 1's shard is found and named."""
    run_dir = tmp_path / "run"
    parallel = {"dp_shard": 2, "nproc": 2}
    run_ranks(train, 2, tiny_spec(small_corpus, run_dir, run={"steps": 6, "stop_at": 4},
                                  checkpoint={"enabled": True, "every": 2}, parallel=parallel))
    meta = json.loads((run_dir / "checkpoints" / "step-000004" / "meta.json").read_text())
    assert "__1_0.distcp" in meta["files"] and len(meta["files"]["__1_0.distcp"]["sha256"]) == 64
    flip(run_dir / "checkpoints" / "step-000004" / "__1_0.distcp")
    run_ranks(train, 2, tiny_spec(small_corpus, run_dir, run={"steps": 6},
                                  checkpoint={"enabled": True, "every": 2}, parallel=parallel),
              True)
    (rejected,) = events(run_dir, "checkpoint_rejected")
    assert rejected["problems"] == ["__1_0.distcp has the wrong SHA-256 (its bytes changed "
                                    "after the save)"]
    assert events(run_dir, "resume")[-1]["path"].endswith("step-000002")


def test_retention_keeps_last_and_every(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    train_single(tiny_spec(small_corpus, run_dir, run={"steps": 7},
                           checkpoint={"enabled": True, "every": 1, "keep_last": 2,
                                       "keep_every": 3}))
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step"))
    assert kept == ["step-000003", "step-000006", "step-000007"]
    assert torch.load(run_dir / "checkpoints" / "step-000007" / "rng" / "rank-00000.pt",
                      weights_only=True)["cpu"].dtype == torch.uint8
