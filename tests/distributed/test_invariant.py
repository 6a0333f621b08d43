"""determinism = "invariant": identical bits across data-parallel layouts and across a resume at
another degree. SHA-256 of the full parameters and optimizer state after 6 steps."""

from __future__ import annotations

import pytest
import torch

from tests.support.compare import state_sha256
from tests.support.ranks import run_ranks
from tests.support.specs import grid, tiny_spec
from tests.support.workers import train, train_single

LAYOUTS = {
    "dp1": (1, {}),
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
    "zero1-2": (2, {"dp_shard": 2, "zero": 1}),
    "zero2-2": (2, {"dp_shard": 2, "zero": 2}),
    "zero3-2": (2, {"dp_shard": 2, "zero": 3}),
    "zero3-4": (4, {"dp_shard": 4, "zero": 3}),
    "hsdp-2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
}
STEPS = 6



def spec_for(corpus, run_dir, layout, **run):
    world, parallel = LAYOUTS[layout]
    return tiny_spec(corpus, run_dir, run={"steps": STEPS, "determinism": "invariant", **run},
                     checkpoint={"enabled": True},
                     parallel={**parallel, "nproc": world}), world


def run(spec, world, resume=False):
    return train_single(spec, resume) if world == 1 else run_ranks(train, world, spec, resume)[0]


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    spec, world = spec_for(small_corpus, tmp_path_factory.mktemp("dp1") / "run", "dp1")
    return run(spec, world)


@pytest.mark.parametrize("layout", grid([name for name in LAYOUTS if name != "dp1"],
                                        default=("ddp2", "zero3-2")))
def test_layouts_are_bitwise_identical(layout, reference, small_corpus, tmp_path):
    spec, world = spec_for(small_corpus, tmp_path / "run", layout)
    result = run(spec, world)
    assert result["losses"] == reference["losses"]
    assert result["grad_norms"] == reference["grad_norms"]
    assert state_sha256(result) == state_sha256(reference)


@pytest.mark.grid  # test_verify.py's invariant restart covers a resume at another degree by default
def test_resume_at_another_degree_is_bitwise_identical(reference, small_corpus, tmp_path):
    """zero3-4 -> stop at step 3 -> resume as zero3-2 -> step 6: the same bits as dp1."""
    spec, world = spec_for(small_corpus, tmp_path / "run", "zero3-4", stop_at=3)
    first = run(spec, world)
    spec, world = spec_for(small_corpus, tmp_path / "run", "zero3-2")
    second = run(spec, world, resume=True)
    assert first["losses"] + second["losses"] == reference["losses"]
    assert state_sha256(second) == state_sha256(reference)


def test_fast_mode_is_not_bitwise_invariant(reference, small_corpus, tmp_path):
    """The control: with the backend's own reductions the layouts differ in the last bits —
    otherwise the tests above would prove nothing."""
    world, parallel = LAYOUTS["zero3-2"]
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": STEPS},
                     parallel={**parallel, "nproc": world})
    fast = run_ranks(train, world, spec)[0]
    assert state_sha256(fast) != state_sha256(reference)
    torch.testing.assert_close(torch.tensor(fast["losses"]), torch.tensor(reference["losses"]),
                               rtol=1e-5, atol=0)


def test_strict_repeats_the_same_bits_at_one_layout(small_corpus, tmp_path):
    world, parallel = LAYOUTS["zero3-2"]
    results = []
    for name in ("a", "b"):
        spec = tiny_spec(small_corpus, tmp_path / name, run={"steps": 3, "determinism": "strict"},
                         parallel={**parallel, "nproc": world})
        results.append(run_ranks(train, world, spec)[0])
    assert results[0]["losses"] == results[1]["losses"]
    assert state_sha256(results[0]) == state_sha256(results[1])
