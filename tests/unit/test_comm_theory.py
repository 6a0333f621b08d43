"""The one ring-volume rule and the layouts' textbook minima (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shardwise.planner import comm as plan_comm
from shardwise.telemetry.comm_theory import min_wire_bytes, ring_fraction


@dataclass
class _Dims:
    dp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    cp: int = 1


def test_ring_fractions():
    assert ring_fraction("all_reduce", 4) == 1.5
    assert ring_fraction("all_gather", 4) == ring_fraction("reduce_scatter", 4) == 0.75
    assert ring_fraction("all_to_all", 2) == 0.5
    assert (ring_fraction("send", 1), ring_fraction("p2p", 8)) == (1.0, 1.0)
    assert ring_fraction("recv", 4) == ring_fraction("barrier", 4) == 0.0
    assert ring_fraction("all_reduce", 1) == 0.0


def test_planner_prices_the_same_volume():
    """planner/comm's bandwidth term is the same fraction of the buffer (latency aside)."""
    grp = plan_comm.Group(4, 1, 4, 1e9, 1e9, 1e9, 0.0, 0.0, 0.0)
    assert plan_comm.all_reduce(1e6, grp) == pytest.approx(ring_fraction("all_reduce", 4) * 1e6 / 1e9)
    assert plan_comm.all_gather(1e6, grp) == pytest.approx(ring_fraction("all_gather", 4) * 1e6 / 1e9)


@pytest.mark.parametrize(("dims", "precision", "expected"), [
    (_Dims(dp=4, dp_replicate=4, zero=0), "fp32", 1.5 * 1000 * 4),
    (_Dims(dp=4, zero=1), "bf16", 0.75 * 1000 * 6),
    (_Dims(dp=4, zero=3), "fp32", 0.75 * 1000 * (2 * 2 * 4 + 4)),
    (_Dims(dp=2, dp_replicate=1, zero=2, pp=2), "fp32", None),
])
def test_data_parallel_minima(dims, precision, expected):
    assert min_wire_bytes(dims, precision, 1000, 2, 64, 3, 16) == expected


def test_tensor_parallel_minimum_uses_the_models_own_shape():
    """Two all-reduces of tokens x hidden per layer forward and two backward, plus the embedding
    output and the output layer's input: from the layers and width given, not a default GPT's."""
    tp2 = _Dims(tp=2)
    got = min_wire_bytes(tp2, "fp32", 10**6, 3, tokens_per_micro_batch=128, layers=5, hidden=96)
    assert got == 3 * (8 * 5 + 4) * 0.5 * 128 * 96 * 4
    assert min_wire_bytes(tp2, "fp32", 10**6, 3, 128, layers=0, hidden=0) is None  # no shape
    assert min_wire_bytes(_Dims(tp=2, cp=2), "fp32", 10**6, 3, 128, 5, 96) is None
