"""Context parallel: zigzag layout, ring attention against dense SDPA, and the trainer's cp layouts
against the single-process run.

Ring attention (both `ring` and `allgather` comms) is checked at cp2 and cp4 over gloo: forward
output and the gradients of q, k and v against `scaled_dot_product_attention(is_causal=True)` on
the whole sequence, with grouped-query attention and the shortest sequence the zigzag allows
(2N tokens: one token per chunk).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.errors import SpecError
from shardwise.models import build_model
from shardwise.models.plan import ModelPlan, ModelShape, plan_of
from shardwise.parallel.checks import check_layout, zigzag_seq_lens
from shardwise.parallel.context import (
    CPGroup,
    apply_context_parallel,
    ring_attention,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from shardwise.parallel.dims import ParallelDims
from shardwise.spec.model import ModelSection
from shardwise.verify.layouts import parse_layout
from tests.support.compare import assert_model_close, assert_ranks_match_reference
from tests.support.ranks import run_ranks
from tests.support.specs import (
    WHOLE_SPLIT_DATA,
    WHOLE_SPLIT_EVAL,
    grid,
    held_out_sequences,
    tiny_spec,
)
from tests.support.workers import train, train_single

# (batch, query heads, K/V heads, sequence length as a multiple of 2N, head dim)
CASES = [(2, 4, 2, 1, 8), (1, 4, 4, 4, 16), (2, 6, 2, 3, 8)]
TOL = 2e-6  # fp32: blockwise softmax against SDPA's, absolute, on values O(1)


def test_zigzag_layout_covers_every_position_once():
    for cp in (1, 2, 4):
        seq = 8 * cp
        positions = [zigzag_positions(seq, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq))
        x = torch.arange(3 * seq).view(3, seq)
        parts = [zigzag_shard(x, cp, r) for r in range(cp)]
        for r in range(cp):  # a rank's tokens are the tokens at its positions
            assert torch.equal(parts[r], x[:, positions[r]])
        assert torch.equal(zigzag_unshard(parts), x)
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
    assert zigzag_seq_lens(30, 4) == [16, 24, 32, 40]


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    repeat = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1),
                                          v.repeat_interleave(repeat, 1), is_causal=True)


def _ring_worker(store: Any, comms: tuple[str, ...]) -> list[dict[str, float]]:
    """Every case and comm on this rank: max |ring - dense| of the output and of dq, dk, dv."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    diffs = []
    try:
        for (b, h, hkv, mult, d), comm in ((case, c) for case in CASES for c in comms):
            cp = CPGroup(dist.group.WORLD, rank, world, comm)
            t = 2 * world * mult
            gen = torch.Generator().manual_seed(1000 * t + h)
            q, k, v = (torch.randn(b, n, t, d, generator=gen) for n in (h, hkv, hkv))
            dout = torch.randn(b, h, t, d, generator=gen)
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = _dense(*full)
            ref.backward(dout)
            local = [zigzag_shard(x, world, rank, dim=2).requires_grad_() for x in (q, k, v)]
            out = ring_attention(*local, cp)
            out.backward(zigzag_shard(dout, world, rank, dim=2))
            want_out = zigzag_shard(ref, world, rank, dim=2)
            row = {"comm": comm, "t": t, "out": (out - want_out).abs().max().item()}
            for name, mine, whole in zip(("dq", "dk", "dv"), local, full, strict=True):
                want = zigzag_shard(whole.grad, world, rank, dim=2)
                row[name] = (mine.grad - want).abs().max().item()
            diffs.append(row)
    finally:
        dist.destroy_process_group()
    return diffs


@pytest.mark.parametrize("world", grid([2, 4], default=(2,)))
def test_ring_attention_matches_dense(world):
    results = run_ranks(_ring_worker, world, ("ring", "allgather"), timeout=180)
    worst = max(v for rank in results for row in rank for k, v in row.items()
                if k in ("out", "dq", "dk", "dv"))
    assert worst <= TOL, f"cp{world}: max |diff| {worst:.3e} > {TOL}: {results}"


# --- through the trainer: cp layouts against the single-process run ---------------------------
MODEL = {"n_layers": 4, "tie_embeddings": False}
OPTIM = {"lr": 2e-3, "min_lr": 2e-4}  # as test_parity_grid: AdamW's amplification below 1e-5


def _eval(seq_len: int) -> dict:
    """The whole split at the usual length; 4 batches of the shortest (thousands of sequences)."""
    return WHOLE_SPLIT_EVAL if seq_len >= 32 else {"batches": 4}


def _data(seq_len: int) -> dict:
    """The whole-split held-out fraction at the usual length (its odd sequence count checked by
    the reference), the default at the shortest."""
    return {"seq_len": seq_len, **(WHOLE_SPLIT_DATA if seq_len >= 32 else {})}

LAYOUTS = {
    "cp2": (2, {"cp": 2, "dp_shard": 1}, 32),
    "cp2-allgather": (2, {"cp": 2, "dp_shard": 1, "cp_comm": "allgather"}, 32),
    "cp2-shortest": (2, {"cp": 2, "dp_shard": 1}, 4),  # one token per zigzag chunk
    "cp4": (4, {"cp": 4, "dp_shard": 1}, 32),
    "cp4-shortest": (4, {"cp": 4, "dp_shard": 1}, 8),
    "zero3-2+cp2": (4, {"cp": 2, "dp_shard": 2, "zero": 3}, 32),
    "ddp2+cp2": (4, {"cp": 2, "dp_replicate": 2, "dp_shard": 1, "zero": 0}, 32),
    # tp innermost, then cp; FSDP over the cp ranks alone (dp_shard = 1), 2-D with tp
    "zero3-1+tp2+cp2": (4, {"cp": 2, "tp": 2, "dp_shard": 1, "zero": 3}, 32),
    "zero3-1+tp2+cp2+sp": (4, {"cp": 2, "tp": 2, "dp_shard": 1, "zero": 3,
                               "sequence_parallel": True}, 32),
    # context inside pipeline stages: each stage supplies its tokens' positions
    "cp2+pp2": (4, {"cp": 2, "pp": 2, "dp_shard": 1, "zero": 0}, 32),
    "zero3-1+cp2+pp2-zero-bubble": (4, {"cp": 2, "pp": 2, "dp_shard": 1, "zero": 3,
                                        "pp_schedule": "zero-bubble",
                                        "pp_virtual_stages": 2}, 32),
    "cp2+pp2-interleaved": (4, {"cp": 2, "pp": 2, "dp_shard": 1, "zero": 0,
                                "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}, 32),
    "tp2+cp2+pp2+sp": (8, {"cp": 2, "tp": 2, "pp": 2, "dp_shard": 1, "zero": 0,
                           "sequence_parallel": True}, 32),
}


@pytest.fixture(scope="module")
def references(small_corpus, tmp_path_factory):
    """Single-process runs by sequence length, trained on first use."""
    cache: dict[int, dict] = {}

    def reference(seq_len: int) -> dict:
        if seq_len not in cache:
            spec = tiny_spec(small_corpus, tmp_path_factory.mktemp(f"ref{seq_len}") / "run",
                             model=MODEL, optimizer=OPTIM, eval=_eval(seq_len),
                             data=_data(seq_len))
            if seq_len >= 32:  # a short last micro-batch, unequal shares
                assert held_out_sequences(spec) % 2 == 1
            cache[seq_len] = train_single(spec)
        return cache[seq_len]
    return reference


@pytest.mark.parametrize("layout", grid(LAYOUTS, default=("cp2",)))
def test_cp_layout_matches_single_process(layout, references, small_corpus, tmp_path):
    world, parallel, seq_len = LAYOUTS[layout]
    reference = references(seq_len)
    spec = tiny_spec(small_corpus, tmp_path / "run", model=MODEL, optimizer=OPTIM,
                     eval=_eval(seq_len), data=_data(seq_len),
                     parallel={**parallel, "nproc": world})
    results = run_ranks(train, world, spec, timeout=240)
    assert_ranks_match_reference(results, reference)
    # (every pipeline stage holds some of the moments: all ranks together hold them all)
    moments = {k: v.float() for r in results for k, v in r["optim"].items() if "exp_avg" in k}
    assert_model_close(moments, {k: reference["optim"][k].float() for k in moments}, rtol=1e-4)
    assert len(moments) == len([k for k in reference["optim"] if "exp_avg" in k])
    assert reference["losses"][-1] < reference["losses"][0] - 0.05
    (step, want), = reference["val_losses"].items()
    for r in results:  # the same held-out tokens, each counted once across the cp ranks
        assert r["val_losses"][step] == pytest.approx(want, rel=1e-5), r["val_losses"]
    if world == parallel["cp"]:  # cp peers read the same samples
        assert all(r["next_indices"] == results[0]["next_indices"] for r in results)


# --- what is refused, layout names, the model's positions ---------------------------------------
def _cp_spec(small_corpus, tmp_path, **parallel):
    return tiny_spec(small_corpus, tmp_path / "run", parallel={"dp_shard": 1, **parallel})


def test_seq_len_the_zigzag_cannot_split_is_refused_with_the_numbers(small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", data={"seq_len": 30},
                     parallel={"cp": 4, "dp_shard": 1})
    dims = ParallelDims.from_spec(spec.parallel, 4)
    plan = plan_of(build_model(spec.model, vocab_size=64, seq_len=30, seed=0))
    with pytest.raises(SpecError, match=r"data.seq_len = 30 is not a multiple of 8.*"
                                        r"16, 24, 32, 40; or a cp that divides 15"):
        check_layout(spec, dims, plan, accumulation=4)


def test_cp_layouts_that_cannot_run_are_refused(small_corpus, tmp_path):
    spec = _cp_spec(small_corpus, tmp_path, cp=2)
    gpt = plan_of(build_model(spec.model, vocab_size=64, seq_len=32, seed=0))
    assert gpt.attention and gpt.positions == "positions"
    no_positions = ModelPlan(shape=gpt.shape, attention=gpt.attention)
    with pytest.raises(SpecError, match="declares no `positions`"):
        check_layout(spec, ParallelDims.from_spec(spec.parallel, 2), no_positions, 4)
    piped = _cp_spec(small_corpus, tmp_path, cp=2, pp=2)  # runs now (was refused)
    check_layout(piped, ParallelDims.from_spec(piped.parallel, 4), gpt, 4)
    # zero 0 over the cp ranks with tp: the optimizers reduce (parallel/flat_dp.py; was refused)
    ddp_tp = _cp_spec(small_corpus, tmp_path, cp=2, tp=2, zero=0)
    assert ParallelDims.from_spec(ddp_tp.parallel, 4).describe() == "cp2+tp2"
    # FSDP may shard over the cp ranks alone (that is how cp composes with tp at dp = 1)
    assert ParallelDims.from_spec(_cp_spec(small_corpus, tmp_path, cp=2, tp=2, zero=3).parallel,
                                  4).describe() == "zero3-1+cp2+tp2"


def test_an_attention_that_cannot_be_swapped_is_refused():
    plan = ModelPlan(shape=ModelShape(params=1), attention="0", positions="positions")
    with pytest.raises(SpecError, match=r"\['0'\] have no `attention_fn"):
        apply_context_parallel([torch.nn.Sequential(torch.nn.Linear(2, 2))], plan, None, 0, 2,
                               "ring")


@pytest.mark.parametrize(("name", "world", "expect"), [
    ("cp2", 2, {"cp": 2, "cp_comm": "ring", "dp_shard": 1}),
    ("cp4-allgather", 4, {"cp": 4, "cp_comm": "allgather"}),
    ("zero3-2+cp2", 4, {"cp": 2, "dp_shard": 2, "zero": 3}),
    ("zero3-1+tp2+cp2", 4, {"cp": 2, "tp": 2, "dp_shard": 1, "zero": 3}),
    ("dp1", 1, {"cp": 1}),
])
def test_cp_layout_names(name, world, expect):
    layout = parse_layout(name)
    assert layout.world_size == world
    assert {k: layout.parallel[k] for k in expect} == expect


def test_true_positions_give_the_rotary_angles_of_those_tokens():
    """Positions 0..T-1 are bit-identical to none (the path without context parallel); a chunk
    run alone at positions 4..7 uses the tables' rows 4..7, and since rotary attention sees only
    relative positions it gives what the same tokens give at 0..3, up to rounding."""
    model = build_model(ModelSection.of(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2),
                        vocab_size=64, seq_len=16, seed=0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens)
        assert torch.equal(model(tokens, positions=torch.arange(16)), whole)
        first = model(tokens[:, 4:8], positions=torch.arange(4, 8))
        shifted = model(tokens[:, 4:8])  # the same tokens as if they started the sequence
    # relative positions are what rotary attention sees: same within the chunk
    torch.testing.assert_close(first, shifted, rtol=1e-5, atol=1e-5)
