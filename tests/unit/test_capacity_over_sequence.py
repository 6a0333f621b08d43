"""Capacity routing under context parallel, without a process group: each cp rank, holding two
zigzag chunks of every sequence, keeps exactly the assignments the single process keeps."""

from __future__ import annotations

import pytest
import torch

from shardwise.models.moe import _apply_capacity, _apply_capacity_over_sequence
from shardwise.parallel.context import zigzag_positions, zigzag_shard


class FakeSplit:
    """`parallel.context.SequenceSplit` for one cp rank, its peers' tensors supplied in turn."""

    active = True

    def __init__(self, rank: int, size: int, peers: list[list[torch.Tensor]]) -> None:
        self.rank, self.size, self.peers = rank, size, peers

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        raise AssertionError("capacity routing sums nothing")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        gathered = self.peers.pop(0)
        assert torch.equal(gathered[self.rank], t)  # this rank's own entry is what it passes
        return torch.stack(gathered)

    def token_index(self, rows: int, local_len: int, device: torch.device) -> torch.Tensor:
        whole = local_len * self.size
        return (torch.arange(rows).unsqueeze(1) * whole
                + zigzag_positions(whole, self.size, self.rank)).reshape(-1)


def _local(rank: int, cp: int, assigned: torch.Tensor, rows: int, seq: int, k: int):
    """A rank's (order, assigned, global assignment numbers) from the whole micro-batch's."""
    per_token = assigned.view(rows, seq, k)
    mine = zigzag_shard(per_token, cp, rank, dim=1).reshape(-1)
    tokens = zigzag_shard(torch.arange(rows * seq).view(rows, seq), cp, rank, dim=1).reshape(-1)
    numbers = (tokens.unsqueeze(1) * k + torch.arange(k)).reshape(-1)
    return mine.argsort(stable=True), mine, numbers


@pytest.mark.parametrize(("cp", "rows", "seq", "k", "e", "factor"),
                         [(2, 2, 8, 2, 4, 1.0), (4, 3, 16, 2, 4, 0.5), (2, 1, 12, 1, 3, 0.8)])
def test_every_cp_rank_keeps_what_one_process_keeps(cp, rows, seq, k, e, factor):
    gen = torch.Generator().manual_seed(cp * 100 + seq)
    skew = torch.tensor([4.0] + [1.0] * (e - 1))  # one crowded expert: drops happen
    assigned = torch.stack([torch.multinomial(skew, k, generator=gen) for _ in range(rows * seq)])
    assigned = assigned.reshape(-1)
    n = rows * seq
    capacity = -(-int(factor * n * k * 1000) // (e * 1000))  # ceil(factor * n * k / e)
    counts = torch.bincount(assigned, minlength=e)
    order, kept_counts = _apply_capacity(assigned.argsort(stable=True), assigned, counts, capacity)
    want = set(order.tolist())  # the single process's kept assignment numbers
    assert len(want) < n * k  # some were dropped
    locals_ = [_local(r, cp, assigned, rows, seq, k) for r in range(cp)]
    got: set[int] = set()
    total = torch.zeros(e, dtype=torch.int64)
    for rank, (order_r, assigned_r, numbers_r) in enumerate(locals_):
        peers = [[numbers for _, _, numbers in locals_], [a for _, a, _ in locals_]]
        split = FakeSplit(rank, cp, peers)
        kept, kept_r = _apply_capacity_over_sequence(order_r, assigned_r, k, e, capacity, split,
                                                      rows, seq // cp)
        assert torch.equal(kept_r, torch.bincount(assigned_r[kept], minlength=e))
        assert torch.equal(assigned_r[kept], assigned_r[kept].sort(stable=True).values)  # by expert
        got |= set(numbers_r[kept].tolist())
        total += kept_r
    assert got == want
    assert torch.equal(total, kept_counts)
