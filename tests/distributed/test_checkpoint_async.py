"""Async checkpoints: the step loop waits only for the copy to host memory, and what lands on disk
is what a synchronous save writes. A save killed or failing in the background leaves only a
`.staging` directory, which is never loaded."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.staging import HostStager
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single

FSDP2 = {"nproc": 2, "dp_shard": 2}


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == kind]


def _state(checkpoint, tmp_path):
    """Everything DCP stored, as one nested dict of full tensors."""
    out = tmp_path / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    rng = {p.name: torch.load(p, weights_only=True)["cpu"] for p in (checkpoint / "rng").iterdir()}
    return state, rng


def _assert_same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}/{key}")
    else:
        assert a == b, where


def test_host_copy_never_aliases_live_tensors():
    """The staged copy must not share memory with the parameters the next step overwrites (DCP's
    own staging only moves tensors to the CPU in some torch versions: a no-op on a CPU run)."""
    live = {"w": torch.ones(4), "nested": {"m": [torch.zeros(2), 3]}, "n": "text"}
    staged = HostStager().stage(live)
    live["w"].add_(1)
    live["nested"]["m"][0].add_(1)
    assert torch.equal(staged["w"], torch.ones(4))
    assert torch.equal(staged["nested"]["m"][0], torch.zeros(2))
    assert staged["nested"]["m"][1] == 3 and staged["n"] == "text"


@pytest.mark.grid  # 15 s
def test_async_and_sync_saves_load_to_identical_state(small_corpus, tmp_path):
    """FSDP at world 2, checkpoints at steps 2 and 4, once async and once synchronous: every
    tensor, the rng files and the file list of meta.json are the same. The async step-2 save
    was written while steps 3-4 trained on, so a staged copy that aliased the live parameters
    would show up here."""
    dirs = {}
    for mode in (True, False):
        run_dir = tmp_path / ("async" if mode else "sync")
        run_ranks(train, 2, tiny_spec(small_corpus, run_dir, run={"steps": 4, "determinism": "strict"},
                                      checkpoint={"enabled": True, "every": 2, "async_save": mode},
                                      parallel=FSDP2))
        dirs[mode] = run_dir
        (first, second) = events(run_dir, "checkpoint")
        assert [first["step"], second["step"]] == [2, 4]
        assert first["mode"] == ("async" if mode else "sync")
        assert first["bytes"] > 0 and first["stall_s"] > 0
        # the step loop waits for the whole of a synchronous save; an async one writes behind it
        assert (first["write_s"] > 0) if mode else (first["write_s"] == 0)
        assert first["device_peak_bytes"] is None  # CPU
        # async: one reused host buffer per tensor this rank holds — its half of the parameters
        # (the tied embedding once) and of the AdamW state; synchronous saves stage nothing
        state = events(run_dir, "model_state")[0]
        held = state["param_bytes_per_rank"][0] + state["optimizer_bytes_per_rank"][0]
        assert first["host_staging_bytes"] == (held if mode else 0)
        assert second["host_staging_bytes"] == first["host_staging_bytes"]
    for step in ("step-000002", "step-000004"):
        a, b = (dirs[m] / "checkpoints" / step for m in (True, False))
        state_a, rng_a = _state(a, tmp_path)
        state_b, rng_b = _state(b, tmp_path)
        _assert_same(state_a, state_b, step)
        _assert_same(rng_a, rng_b, f"{step}/rng")
        files = [json.loads((c / "meta.json").read_text())["files"] for c in (a, b)]
        assert files[0].keys() == files[1].keys()
        assert not list(dirs[True].glob("checkpoints/*.staging"))


def test_killed_async_save_leaves_no_loadable_checkpoint(small_corpus, tmp_path, capfd):
    """Rank 0 is killed in the background write of the step-4 save (shards written, nothing
    committed) while its step loop runs on: step-000004.staging is left, never loaded, and the
    resume (here at world 1) continues from step 2."""
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 6},
                     checkpoint={"enabled": True, "every": 2, "async_save": True},
                     failure={"faults": "kill:rank=0:step=4:phase=checkpoint-write"},
                     parallel=FSDP2)
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_ranks(train, 2, spec, timeout=120)
    root = run_dir / "checkpoints"
    staging = root / "step-000004.staging"
    assert staging.is_dir() and list(staging.glob("*.distcp"))
    assert not (staging / "meta.json").exists() and not (root / "step-000004").exists()
    checkpointer = Checkpointer(root, 0, False)
    assert [p.name for p in checkpointer.candidates()] == ["step-000002"]
    assert checkpointer.find_valid() == (root / "step-000002", [])
    result = train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6},
                                    checkpoint={"enabled": True, "every": 2}), resume=True)
    assert events(run_dir, "resume")[-1]["path"].endswith("step-000002")
    err = capfd.readouterr().err  # the claim of the location removes the interrupted save
    assert f"removing {staging}" in err and len(result["losses"]) == 4
    assert (root / "step-000004" / "meta.json").is_file()  # the next save of step 4 replaced it


def test_background_failure_surfaces_and_commits_nothing(small_corpus, tmp_path):
    """An exception in the background part of an async save is raised in the step loop (at the
    next save or the end of the run), naming the checkpoint, which stays uncommitted."""
    from shardwise.resilience.faults import InjectedFault

    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 3},
                     checkpoint={"enabled": True, "every": 2, "async_save": True},
                     failure={"faults": "raise:step=2:phase=checkpoint-write"})
    with pytest.raises(InjectedFault) as info:
        train_single(spec)
    assert any("step-000002" in note for note in info.value.__notes__)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
        "step-000002.staging"]
