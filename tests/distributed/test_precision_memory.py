"""fp16 dynamic loss scaling and activation checkpointing, each against a reference run (the
precision policy across layouts is in test_precision_policy.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.compare import assert_model_close
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single


@pytest.fixture(scope="module")
def fp32(small_corpus, tmp_path_factory):
    return train_single(tiny_spec(small_corpus, tmp_path_factory.mktemp("fp32") / "run"))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_the_same_numbers(mode, fp32, small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run",
                     memory={"activation_checkpoint": mode, "ac_every": 2})
    result = train_single(spec)
    assert result["losses"] == fp32["losses"]  # recomputation is bit-identical on one process
    for name, value in fp32["params"].items():
        assert torch.equal(result["params"][name], value), name


def test_activation_checkpointing_under_fsdp(fp32, small_corpus, tmp_path):
    """Recompute under FSDP: parameters and optimizer state as the fp32 single process, to the
    parity grid's tolerance (ZeRO-3 re-gathers the checkpointed blocks' weights in backward)."""
    spec = tiny_spec(small_corpus, tmp_path / "run", memory={"activation_checkpoint": "full"},
                     parallel={"dp_shard": 2, "nproc": 2})
    result = run_ranks(train, 2, spec)[0]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(fp32["losses"]),
                               rtol=1e-5, atol=0)
    assert_model_close(result["params"], fp32["params"], rtol=1e-5)
    for key, value in fp32["optim"].items():
        torch.testing.assert_close(result["optim"][key], value, rtol=1e-3, atol=1e-9)


def test_fp16_overflow_backs_off_and_skips(small_corpus, tmp_path):
    """A loss scale of 2^22 overflows fp16 gradients: those steps are skipped (no update) and
    the scale halves each time until the gradients fit; training then proceeds."""
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"precision": "fp16", "steps": 12},
                     loss_scale={"init_scale": 2.0**22, "growth_interval": 1000})
    result = train_single(spec)
    state = result["loss_scale"]
    skipped = state["skipped_steps"]
    assert 1 <= skipped < 12
    assert state["scale"] == 2.0 ** (22 - skipped)
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["losses"][-1] < result["losses"][0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compiled_blocks_match_eager(fp32, small_corpus, tmp_path):
    """torch.compile per block (memory.compile): same losses as eager within 1e-5. Slow on CPU
    (a cold compile takes tens of seconds), so outside the default test run: `pytest -m slow`."""
    result = train_single(tiny_spec(small_corpus, tmp_path / "run", memory={"compile": True}))
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(fp32["losses"]),
                               rtol=1e-5, atol=0)
