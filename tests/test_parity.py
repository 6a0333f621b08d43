"""Multi-rank layouts match the single-process run of the same global batch.

fp32, 5 steps, tiny GPT: per-step loss within 1e-5 relative, final parameters within 1e-5 relative
(gathered to full tensors), for DDP world 2, FSDP world 2 and 4, HSDP 2x2.
"""

from __future__ import annotations

import pytest
import torch

from conftest import grid, tiny_spec
from shardwise.utils.local_ranks import run_ranks
from workers import train, train_single

LAYOUTS = {
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
    "fsdp2": (2, {"dp_shard": 2}),
    "fsdp4": (4, {"dp_shard": 4}),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
}


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    spec = tiny_spec(small_corpus, tmp_path_factory.mktemp("ref") / "run")
    result = train_single(spec)
    # clipping (optimizer.grad_clip = 1.0) is active in these steps, so it is tested too
    assert max(result["grad_norms"]) > 1.0
    return result


def test_accumulation_equals_one_large_batch(reference, small_corpus, tmp_path):
    """4 accumulated micro-batches of 2 == 1 micro-batch of 8 (maxtext's accumulation test)."""
    spec = tiny_spec(small_corpus, tmp_path / "run", batch={"micro_batch": 8})
    result = train_single(spec)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=0)
    assert_params_close(result["params"], reference["params"], rtol=1e-5)


def assert_model_close(got: dict, want: dict, rtol: float, atol_max: float = 1e-4) -> None:
    """The whole parameter vector: ||got - want|| <= rtol * ||want|| over all tensors together,
    and no single element off by more than `atol_max` (AdamW can push one element whose gradient
    is almost zero further than the rest; this bounds it)."""
    assert got.keys() == want.keys()
    diff = sum((got[k] - want[k]).double().pow(2).sum() for k in want).sqrt().item()
    ref = sum(want[k].double().pow(2).sum() for k in want).sqrt().item()
    worst = max(want, key=lambda k: (got[k] - want[k]).abs().max().item())
    worst_abs = (got[worst] - want[worst]).abs().max().item()
    assert diff <= rtol * ref, f"||diff|| {diff:.3e} > {rtol} * ||ref|| {ref:.3e}; worst {worst}"
    assert worst_abs <= atol_max, f"{worst}: max |diff| {worst_abs:.3e} > {atol_max}"


def assert_ranks_match_reference(results: list[dict], reference: dict) -> None:
    """Every rank reports the reference's global losses (1e-5) and gradient norms (1e-4: the
    norm is a long reduction whose rounding differs more, seen 1.5e-5), and rank 0's parameters
    match the reference's as a whole vector (1e-5)."""
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r["grad_norms"]),
                                   torch.tensor(reference["grad_norms"]), rtol=1e-4, atol=0)
    assert_model_close(results[0]["params"], reference["params"], rtol=1e-5)


def assert_params_close(got: dict, want: dict, rtol: float) -> None:
    """Per tensor: ||got - want|| <= rtol * ||want|| (L2 over all elements)."""
    assert got.keys() == want.keys()
    for name in want:
        diff = (got[name] - want[name]).norm().item()
        scale = want[name].norm().item()
        assert diff <= rtol * scale, (
            f"{name}: ||diff|| {diff:.3e} > {rtol} * ||ref|| {scale:.3e} "
            f"(max |diff| {(got[name] - want[name]).abs().max().item():.3e})")


@pytest.mark.parametrize("layout", grid(LAYOUTS, default=("ddp2", "fsdp2")))
def test_layout_matches_single_process(layout, reference, small_corpus, tmp_path):
    world, parallel = LAYOUTS[layout]
    spec = tiny_spec(small_corpus, tmp_path / "run", parallel={**parallel, "nproc": world})
    results = run_ranks(train, world, spec)
    losses = results[0]["losses"]
    assert len(losses) == 5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=0)
    # every rank reports the same global loss
    for r in results[1:]:
        assert r["losses"] == losses
    # the global gradient norm (clipping input) is the same number however it is sharded
    torch.testing.assert_close(torch.tensor(results[0]["grad_norms"]),
                               torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0)
    assert_params_close(results[0]["params"], reference["params"], rtol=1e-5)
    assert results[0]["threads"] == 1  # 2 cores / 2+ local workers
    # the loss actually moved: the comparison is not between two untrained models
    assert losses[-1] < losses[0] - 0.1
