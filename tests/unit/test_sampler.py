"""The global-index sampler: coverage, independence from world size, resume, and epochs.

Everything runs on a synthetic token stream (no tokenizer): tokens[i] = i % 500, so each packed
sequence is identified by its contents and the reference for any sample can be computed by hand.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from shardwise.data.loader import TrainBatches
from shardwise.data.sampler import BatchLayout, GlobalSampler, PackedSequences
from shardwise.errors import SpecError, UserError

SEQ_LEN = 32
TOKENS = np.arange(10_000) % 500
N = (len(TOKENS) - 1) // SEQ_LEN  # 312 packed sequences
GLOBAL_BATCH = 16  # 312 / 16 = 19.5: step 19 straddles the epoch boundary
MICRO = 2
SEED = 11
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sequences() -> PackedSequences:
    return PackedSequences(TOKENS, SEQ_LEN)


def reference_perm(seed: int, epoch: int, n: int = N) -> np.ndarray:
    """The documented keyed permutation: PCG64 seeded with (seed, epoch)."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)


def reference_sequence_id(global_index: int, seed: int = SEED) -> int:
    epoch, offset = divmod(global_index, N)
    return int(reference_perm(seed, epoch)[offset])


def loaders(sequences: PackedSequences, dp: int, seed: int = SEED) -> list[TrainBatches]:
    layout = BatchLayout.checked(GLOBAL_BATCH, MICRO, dp)
    return [TrainBatches(sequences, seed, layout, rank, CPU) for rank in range(dp)]


def test_packed_sequences_are_windows(sequences):
    assert len(sequences) == N == 312
    x, y = sequences.batch(np.array([0, 5, 311]))
    assert x.shape == y.shape == (3, SEQ_LEN)
    assert x.dtype == y.dtype == torch.int64
    for row, s in enumerate([0, 5, 311]):
        want = torch.from_numpy(TOKENS[s * SEQ_LEN: s * SEQ_LEN + SEQ_LEN + 1].astype(np.int64))
        assert torch.equal(x[row], want[:-1])
        assert torch.equal(y[row], want[1:])


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("step", [0, 1, 19, 40])
def test_ranks_cover_step_range_disjointly(dp, step):
    layout = BatchLayout.checked(GLOBAL_BATCH, MICRO, dp)
    per_rank = [layout.rank_indices(step * GLOBAL_BATCH, r) for r in range(dp)]
    for micro in per_rank:
        assert len(micro) == GLOBAL_BATCH // (MICRO * dp)  # accumulation steps
        for idx in micro:
            assert len(idx) == MICRO
            assert np.array_equal(idx, np.arange(idx[0], idx[0] + MICRO))  # consecutive
    everything = np.concatenate([i for micro in per_rank for i in micro])
    assert len(everything) == GLOBAL_BATCH  # no overlap ...
    assert np.array_equal(np.sort(everything),  # ... and exactly the step's range
                          np.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    # micro-batch j of the step goes to rank j mod dp
    for r, micro in enumerate(per_rank):
        for idx in micro:
            j = (idx[0] - step * GLOBAL_BATCH) // MICRO
            assert j % dp == r


def test_one_epoch_is_a_permutation():
    sampler = GlobalSampler(N, SEED)
    ids = sampler.sequence_ids(np.arange(N))
    assert np.array_equal(np.sort(ids), np.arange(N))
    assert np.array_equal(ids, reference_perm(SEED, 0))
    assert not np.array_equal(ids, np.arange(N))  # actually shuffled


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_epoch_seen_through_the_ranks_is_a_permutation(sequences, dp):
    """Read the ranks' micro-batches for the whole first epoch: each sequence exactly once."""
    ranks = loaders(sequences, dp)
    seen = []
    full_steps = N // GLOBAL_BATCH
    for _ in range(full_steps):
        for loader in ranks:
            for idx in loader.step_indices():
                seen.extend(loader.sampler.sequence_ids(idx).tolist())
            loader.next_step()
    assert len(seen) == len(set(seen)) == full_steps * GLOBAL_BATCH
    assert sorted(seen) == sorted(reference_perm(SEED, 0)[: full_steps * GLOBAL_BATCH].tolist())


def test_sampler_is_independent_of_world_size(sequences):
    """The same global index maps to the same sequence id whatever D; the layout only decides
    which rank reads it."""
    steps = 21  # crosses the epoch boundary at global index 312
    by_dp = {}
    for dp in (1, 2, 4):
        mapping = {}
        for loader in loaders(sequences, dp):
            for step in range(steps):
                for idx in loader.layout.rank_indices(step * GLOBAL_BATCH, loader.dp_rank):
                    for i, s in zip(idx.tolist(), loader.sampler.sequence_ids(idx).tolist(),
                                    strict=True):
                        assert i not in mapping
                        mapping[i] = s
        assert sorted(mapping) == list(range(steps * GLOBAL_BATCH))
        by_dp[dp] = mapping
    assert by_dp[1] == by_dp[2] == by_dp[4]
    for i in (0, 1, 17, 311, 312, 313, 335):
        assert by_dp[1][i] == reference_sequence_id(i)


def step_rows(ranks: list[TrainBatches]) -> tuple[dict[int, tuple], int]:
    """Run one step on every rank; map each global index to its (input, target) rows."""
    rows = {}
    tokens = set()
    for loader in ranks:
        indices = loader.step_indices()
        batches, n_tokens = loader.next_step()
        tokens.add(n_tokens)
        assert len(batches) == len(indices) == loader.layout.accumulation
        for idx, (x, y) in zip(indices, batches, strict=True):
            assert x.shape == y.shape == (MICRO, SEQ_LEN)
            for k, i in enumerate(idx.tolist()):
                rows[i] = (x[k], y[k])
    assert tokens == {GLOBAL_BATCH * SEQ_LEN}
    return rows, tokens.pop()


def test_batch_content_is_identical_across_world_sizes(sequences):
    steps = 21
    contents = {}
    for dp in (1, 2, 4):
        ranks = loaders(sequences, dp)
        merged = {}
        for _ in range(steps):
            rows, _ = step_rows(ranks)
            assert not rows.keys() & merged.keys()  # no global index read twice
            merged.update(rows)
        assert len(merged) == steps * GLOBAL_BATCH
        contents[dp] = merged
    # every D reads the same global indices, and the same tokens for each of them
    assert contents[1].keys() == contents[2].keys() == contents[4].keys()
    for i, (x1, y1) in contents[1].items():
        for dp in (2, 4):
            assert torch.equal(contents[dp][i][0], x1)
            assert torch.equal(contents[dp][i][1], y1)
        # and the content is the window of the reference sequence id for that global index
        s = reference_sequence_id(i)
        want = torch.from_numpy(TOKENS[s * SEQ_LEN: s * SEQ_LEN + SEQ_LEN + 1].astype(np.int64))
        assert torch.equal(x1, want[:-1])
        assert torch.equal(y1, want[1:])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_loader_step_k_reads_the_step_range(sequences, dp):
    """The loader's step k is exactly global indices [k*B, (k+1)*B), from the start or resumed."""
    ranks = loaders(sequences, dp)
    for k in range(3):
        got = np.sort(np.concatenate([i for r in ranks for i in r.step_indices()]))
        assert np.array_equal(got, np.arange(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH))
        for r in ranks:
            r.next_step()
    for r in ranks:
        r.load_state_dict({"consumed_samples": 7 * GLOBAL_BATCH, "seed": SEED})
    got = np.sort(np.concatenate([i for r in ranks for i in r.step_indices()]))
    assert np.array_equal(got, np.arange(7 * GLOBAL_BATCH, 8 * GLOBAL_BATCH))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("k", [0, 3, 19, 25])
def test_resume_from_consumed_samples(sequences, dp, k):
    layout = BatchLayout.checked(GLOBAL_BATCH, MICRO, dp)
    for rank in range(dp):
        ran = TrainBatches(sequences, SEED, layout, rank, CPU)
        for _ in range(k):
            ran.next_step()
        state = ran.state_dict()
        assert state == {"consumed_samples": k * GLOBAL_BATCH, "seed": SEED, "skips": "[]"}
        fresh = TrainBatches(sequences, SEED, layout, rank, CPU)
        fresh.load_state_dict({"consumed_samples": k * GLOBAL_BATCH, "seed": SEED})
        for _ in range(2):
            (want, n_want), (got, n_got) = ran.next_step(), fresh.next_step()
            assert n_want == n_got
            assert len(want) == len(got) == layout.accumulation
            for (wx, wy), (gx, gy) in zip(want, got, strict=True):
                assert torch.equal(wx, gx)
                assert torch.equal(wy, gy)
        assert fresh.consumed_samples == (k + 2) * GLOBAL_BATCH


def test_resume_at_another_world_size_reads_the_same_samples(sequences):
    """Resume at dp=4 from the position dp=1 reached after 5 steps: the next step holds the same
    samples, row for row, as the uninterrupted dp=1 run."""
    k = 5
    resumed = loaders(sequences, 4)
    for loader in resumed:
        loader.load_state_dict({"consumed_samples": k * GLOBAL_BATCH, "seed": SEED})
    single = loaders(sequences, 1)
    for _ in range(k):
        single[0].next_step()
    assert single[0].state_dict() == {"consumed_samples": k * GLOBAL_BATCH, "seed": SEED,
                                      "skips": "[]"}
    got, _ = step_rows(resumed)
    want, _ = step_rows(single)
    assert len(want) == GLOBAL_BATCH
    assert got.keys() == want.keys()
    for i in want:
        assert torch.equal(got[i][0], want[i][0])
        assert torch.equal(got[i][1], want[i][1])


def test_resume_with_another_seed_is_refused(sequences):
    layout = BatchLayout.checked(GLOBAL_BATCH, MICRO, 1)
    loader = TrainBatches(sequences, SEED + 1, layout, 0, CPU)
    with pytest.raises(UserError) as info:
        loader.load_state_dict({"consumed_samples": 32, "seed": SEED})
    message = str(info.value)
    assert f"run.seed = {SEED}" in message
    assert f"says {SEED + 1}" in message
    assert f"--set run.seed={SEED}" in message
    assert loader.consumed_samples == 0  # state untouched


def test_different_seeds_give_different_orders():
    a = GlobalSampler(N, 1).sequence_ids(np.arange(N))
    b = GlobalSampler(N, 2).sequence_ids(np.arange(N))
    assert np.array_equal(np.sort(a), np.sort(b))
    assert np.array_equal(a, reference_perm(1, 0))
    assert np.array_equal(b, reference_perm(2, 0))
    assert (a != b).mean() > 0.9  # most positions differ, not just a couple
    # and the same seed gives the same order from a separate sampler
    assert np.array_equal(GlobalSampler(N, 1).sequence_ids(np.arange(N)), a)


def test_later_epochs_wrap_with_new_permutations():
    sampler = GlobalSampler(N, SEED)
    epochs = [sampler.sequence_ids(np.arange(e * N, (e + 1) * N)) for e in range(3)]
    for e, ids in enumerate(epochs):
        assert np.array_equal(np.sort(ids), np.arange(N))
        assert np.array_equal(ids, reference_perm(SEED, e))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    # a request that straddles a boundary (and comes out of order) maps each index by its epoch
    idx = np.array([2 * N + 3, N - 1, N, 5, 2 * N - 1])
    want = [reference_sequence_id(int(i)) for i in idx]
    assert sampler.sequence_ids(idx).tolist() == want


def test_empty_sampler_is_refused():
    with pytest.raises(ValueError, match="no sequences"):
        GlobalSampler(0, SEED)


@pytest.mark.parametrize(("global_batch", "micro", "dp", "accumulation"), [
    (16, 2, 1, 8), (16, 2, 2, 4), (16, 2, 4, 2), (16, 4, 4, 1), (24, 3, 2, 4), (8, 8, 1, 1),
])
def test_layout_accumulation(global_batch, micro, dp, accumulation):
    layout = BatchLayout.checked(global_batch, micro, dp)
    assert layout.micro_batches == global_batch // micro
    assert layout.accumulation == accumulation
    assert layout.accumulation * micro * dp == global_batch
    for r in range(dp):
        assert len(layout.rank_indices(3, r)) == accumulation


@pytest.mark.parametrize(("global_batch", "micro", "dp", "per_step"), [
    (8, 4, 4, 16), (16, 8, 4, 32), (12, 2, 4, 8), (10, 5, 4, 20),
])
def test_layout_refuses_uneven_split(global_batch, micro, dp, per_step):
    with pytest.raises(SpecError) as info:
        BatchLayout.checked(global_batch, micro, dp)
    message = str(info.value)
    assert f"batch.global_batch ({global_batch})" in message
    assert f"batch.micro_batch ({micro})" in message
    assert f"data-parallel degree ({dp}) = {per_step}" in message
    # the suggested global batches are multiples of micro_batch * dp
    suggested = [int(v) for v in re.search(r"Use global_batch (\d+) or (\d+)", message).groups()]
    assert all(v % per_step == 0 and v > 0 for v in suggested)
