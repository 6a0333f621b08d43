"""The memory of a layout's fullest rank (`predict_memory`): what `memory.rank_memory` itemises
for each kind of pipeline rank, at the micro-batches its schedule holds in flight
(`bubble.flights`) and the share of its chunks' gradients that exist at that peak
(`bubble.grad_share_at_peak`). No compute or communication: the search asks for it first."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from shardwise.planner.bubble import flights, grad_share_at_peak, rank_groups
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import MemoryBreakdown, rank_memory
from shardwise.planner.models import ModelDims, as_dims
from shardwise.planner.params import DEFAULT_PARAMS, CostParams
from shardwise.shape import ModelShape


def memory_key(lo: Layout) -> Layout:
    """`lo` as the memory cache keys it: the mesh order moves no byte (`memory.rank_memory`
    reads none of it), so the two orders the search tries on a podded cluster share one entry."""
    return lo if lo.order == MEMORY_ORDER else dataclasses.replace(lo, order=MEMORY_ORDER)


MEMORY_ORDER = Layout().order


def predict_memory(layout: Layout, model: ModelDims | ModelShape, batch: Batch,
                   params: CostParams = DEFAULT_PARAMS,
                   device: str = "cuda") -> tuple[MemoryBreakdown, int]:
    """The memory of the rank with the most, and its rank: without any compute or comm
    (`device`: the cluster's, "cuda" or "cpu")."""
    model = as_dims(model)
    lo = layout
    _, distinct, index = rank_groups(model, lo.pp, lo.v, lo.schedule, batch.seq_len, lo.recompute,
                                     lo.ac_every, params.pp_split)
    per_call, calls = lo.pipeline_calls(max(lo.micro_batches(batch), 1),
                                         params.pipeline_local_batch)
    return peak_memory(memory_key(lo), model, batch, distinct, index, per_call, params, device,
                        calls)


@lru_cache(maxsize=8192)
def peak_memory(lo: Layout, model: ModelDims, batch: Batch, distinct: tuple, index: tuple,
                 m: int, params: CostParams, device: str = "cuda",
                 calls: int = 1) -> tuple[MemoryBreakdown, int]:
    """Memory grows with the micro-batches in flight (`m`: those of one call of the pipeline
    schedule, of `calls` a step): per kind of rank, the one holding most. Cached: the search
    asks for a layout's memory before it predicts its time."""
    held = flights(lo.schedule, lo.pp, lo.v, m)
    # every call of the schedule ends in torch's REDUCE_GRAD, which frees the unsharded
    # gradients: each call's forwards meet only its own (and the shards of earlier calls)
    shares = [grad_share_at_peak(lo.schedule, lo.pp, lo.v, m, r) for r in range(len(index))]
    most: dict[tuple[int, float], int] = {}  # per kind of rank and gradient share
    for r, i in enumerate(index):
        key = (i, shares[r])
        if key not in most or held[r] > held[most[key]]:
            most[key] = r
    worst: tuple[MemoryBreakdown | None, int] = (None, 0)
    for (i, share), r in most.items():
        mem = rank_memory(lo, model, batch, distinct[i], held[r], params, device, share,
                          calls)
        if worst[0] is None or mem.total > worst[0].total:
            worst = (mem, r)
    assert worst[0] is not None
    return worst[0], worst[1]
