"""Pipeline schedules: the bubble, the micro-batches each rank holds in flight, and the layer split.

Bubble, in units of one micro-batch's forward + backward on the slowest rank (p stages, m
micro-batches per step, v stages per rank):
- GPipe, 1F1B: p - 1 (Huang et al. 2019; Narayanan et al. 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", §2.2.1: bubble fraction (p-1)/(m+p-1));
- interleaved 1F1B: (p - 1) / v (ibid. §2.2.2);
- zero-bubble ZBV (v = 2; Qi et al. 2024, "Zero Bubble Pipeline Parallelism" and "Pipeline
  Parallelism with Controllable Memory"): backward is split into input gradients (B) and weight
  gradients (W) that fill the bubble; what is left is (p - 1)(T_F + T_B - 2 T_W) over chunks of
  half a stage, with T_F, T_B, T_W from the FLOPs (W = 2N per token, B = 2N + the attention
  backward): close to zero for matmul-dominated blocks.

In-flight micro-batches (activations held at once), in whole-rank units:
- GPipe: all m (every forward before any backward);
- 1F1B: rank r holds min(m, p - r) (Narayanan et al. 2021; Korthikanti et al. 2022, §4.2.3: the
  first stage holds p);
- interleaved 1F1B: torch's schedule (`torch.distributed.pipelining.schedules._get_warmup_ops`)
  warms up (v - 1) x (micro-batches per round) + 2 (p - 1 - r) chunk forwards; held chunks / v
  (for rank 0 with m >= p: p + (p - 1)/v, Korthikanti et al.'s figure);
- ZBV: min(m, p) on every rank (the V placement balances memory; Qi et al.: the same peak as
  1F1B's first stage).

Layer split: the model's blocks cut into p x v contiguous virtual stages, choosing the cut that
minimises the most expensive stage, where a stage costs its blocks' FLOPs (recompute included)
and the last stage also the output projection (the loss's elementwise work is not modelled).
Stage s sits on rank s mod p (looped placement), or for ZBV on ranks s and 2p-1-s (the V), as
`shardwise.parallel.pipeline.stage_ids` places them.

That is `split = "flops"`, shardwise's own cut. Published stacks cut otherwise
(`CostParams.pp_split`): "even", Megatron's default, cuts the l blocks evenly by count with the
embedding and the head riding on the first and last stages (a large vocabulary then makes the
last stage the slowest); "ends_as_layers" (Megatron's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split; the Llama 3 paper, §3.3.2: "the first model chunk on the
first stage has only the embedding, and the last model chunk on the last stage has only output
projection and loss calculation") counts the embedding and the output head as one block each and
splits the l + 2 units evenly by count: the first and last stages may hold no block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shardwise.planner import op_checkpoint
from shardwise.planner.models import ModelDims


@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds: blocks by kind, which of them are recomputed, and whether
    it runs the embedding (first stage) and the output head and loss (last stage)."""

    dense: int
    moe: int
    ck_dense: int
    ck_moe: int
    first: bool
    last: bool

    def __hash__(self) -> int:  # hashed by every cached cost term: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            self.__dict__["_hash"] = cached
        return cached

    @property
    def blocks(self) -> int:
        return self.dense + self.moe


def stage_ranks(pp: int, v: int, schedule: str) -> list[int]:
    """The rank of each virtual stage (length pp*v)."""
    if schedule == "zero-bubble":
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    return [s % pp for s in range(pp * v)]


def checkpointed(i: int, recompute: str, ac_every: int) -> bool:
    """Block i is recomputed: `full` every block, `selective` every `ac_every`-th (the rule of
    `shardwise.parallel.memory` and `telemetry.flops.recomputed_blocks`); `op` checkpoints every
    block, per op (`planner/op_checkpoint.py`)."""
    return recompute in ("full", "op") or (recompute == "selective" and i % ac_every == 0)


def _layer_costs(model: ModelDims, seq_len: int, recompute: str, ac_every: int) -> list[float]:
    costs = []
    per_kind = {k: model.layer_flops(k, seq_len) for k in ("dense", "moe")}
    for i, kind in enumerate(model.layer_kinds):
        fc = per_kind[kind]
        extra = 0.0
        if recompute == "op":
            extra = op_checkpoint.recompute_flops_per_token(model)
        elif checkpointed(i, recompute, ac_every):
            extra = fc.recompute_per_token(1)
        costs.append(fc.per_token() + extra)
    return costs


@lru_cache(maxsize=4096)
def layer_split(model: ModelDims, stages: int, seq_len: int, recompute: str = "none",
                ac_every: int = 2, split: str = "flops") -> tuple[int, ...]:
    """Blocks per virtual stage (length `stages`): by `split` (see the module docstring),
    "flops" minimising the largest stage cost (blocks' FLOPs + the output projection on the
    last), each stage at least one block."""
    n = model.layers
    if stages <= 1:
        return (n,)
    if split == "ends_as_layers":
        return ends_split(n, stages)
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} blocks")
    if split == "even":
        return tuple(_even(n, stages))
    costs = _layer_costs(model, seq_len, recompute, ac_every)
    head = model.head_flops(seq_len).per_token()
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    lo, hi = max(max(costs), costs[-1] + head), prefix[n] + head
    best = _cut(prefix, head, stages, hi) or _even(n, stages)
    for _ in range(60):
        mid = (lo + hi) / 2
        found = _cut(prefix, head, stages, mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
        if hi - lo <= 1e-9 * hi:
            break
    spread = _cut(prefix, head, stages, hi, spread=True)
    return tuple(spread or best)


def _cut(prefix: list[float], head: float, stages: int, limit: float,
         spread: bool = False) -> list[int] | None:
    """Greedy from the front: each stage takes as many blocks as fit under `limit` while leaving
    one block for every later stage; None if the last stage (which also runs the output
    projection, `head`) overflows. `spread`: a stage stops near its share of what is left
    instead (the plain greedy cut piles the slack onto the last stages; interleaved and ZBV
    placements put several stages on a rank, so even stages keep the ranks even too)."""
    n = len(prefix) - 1
    sizes, start = [], 0
    for s in range(stages - 1):
        target = (prefix[n] - prefix[start] + head) / (stages - s)
        end = start + 1
        while (end < n - (stages - 1 - s)
               and prefix[end + 1] - prefix[start] <= limit * (1 + 1e-12)
               and (not spread or prefix[end + 1] - prefix[start] - target
                    <= target - (prefix[end] - prefix[start]))):
            end += 1
        sizes.append(end - start)
        start = end
    if prefix[n] - prefix[start] + head > limit * (1 + 1e-12):
        return None
    sizes.append(n - start)
    return sizes


def ends_split(n: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage when the embedding (first unit) and the head (last unit) count as blocks:
    n + 2 units split evenly by count, the earlier stages taking the remainder."""
    if stages > n + 2:
        raise ValueError(f"{stages} pipeline stages for {n} blocks, the embedding and the head")
    units = _even(n + 2, stages)
    units[0] -= 1
    units[-1] -= 1
    return tuple(units)


def _even(n: int, stages: int) -> list[int]:
    base, extra = divmod(n, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


@lru_cache(maxsize=4096)
def rank_groups(model: ModelDims, pp: int, v: int, schedule: str, seq_len: int, recompute: str,
                ac_every: int, split: str = "flops"
                ) -> tuple[tuple[int, ...], tuple[RankLoad, ...], tuple[int, ...]]:
    """(the layer split, the distinct loads, the index into them of each of the pp ranks)."""
    sizes, loads = rank_loads(model, pp, v, schedule, seq_len, recompute, ac_every, split)
    distinct = tuple(dict.fromkeys(loads))
    where = {load: i for i, load in enumerate(distinct)}
    return sizes, distinct, tuple(where[load] for load in loads)


@lru_cache(maxsize=4096)
def flights(schedule: str, pp: int, v: int, m: int) -> tuple[float, ...]:
    """`in_flight` of every pipeline rank."""
    return tuple(in_flight(schedule, pp, v, m, r) for r in range(pp))


@lru_cache(maxsize=4096)
def rank_loads(model: ModelDims, pp: int, v: int, schedule: str, seq_len: int, recompute: str,
               ac_every: int, split: str = "flops"
               ) -> tuple[tuple[int, ...], tuple[RankLoad, ...]]:
    """(the blocks per stage, what each of the pp ranks holds; `split`: see `layer_split`)."""
    stages = pp * v if pp > 1 else 1
    sizes = (layer_split(model, stages, seq_len, recompute, ac_every, split) if not model.opaque
             else (0,))
    owner = stage_ranks(pp, v, schedule) if pp > 1 else [0]
    # per rank, RankLoad's fields in order: four counts, then first and last
    acc: list[list[Any]] = [[0, 0, 0, 0, False, False] for _ in range(pp)]
    i = 0
    for s, size in enumerate(sizes if not model.opaque else ()):
        r = acc[owner[s]]
        for layer in range(i, i + size):
            moe = model.is_moe_layer(layer)
            r[1 if moe else 0] += 1
            if checkpointed(layer, recompute, ac_every):
                r[3 if moe else 2] += 1
        i += size
    acc[owner[0]][4] = True
    acc[owner[-1]][5] = True
    return sizes, tuple(RankLoad(*a) for a in acc)


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """Micro-batches whose activations rank `rank` holds at its peak, in whole-rank units."""
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "zero-bubble":
        return float(min(m, pp))
    return min(_interleaved_warmup(pp, v, m, rank) + 1, m * v) / v


def _interleaved_warmup(pp: int, v: int, m: int, rank: int) -> int:
    """Chunk forwards rank `rank` runs before its first backward under interleaved 1F1B
    (Megatron's count: micro-batches in rounds of at least pp)."""
    rounds = max(1, m // pp)
    per_round = m // rounds
    return min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)


def grad_share_at_peak(schedule: str, pp: int, v: int, m: int, rank: int) -> float:
    """The share of rank `rank`'s chunks whose gradients exist while its activations peak.
    Gradients are created by a chunk's first backward. Under interleaved 1F1B (Megatron's order:
    micro-batches in rounds of N >= pp, backward chunk by chunk from the last) the activations
    stay at their peak through the steady 1F1B phase, whose k backwards have reached
    ceil(k / N) chunks, at least the first: a rank that runs every forward before its first
    backward (one round, near the front; Llama 3 405B at m = pp = 16) holds one chunk's.
    Every other schedule's first backward creates all of the rank's gradients: 1."""
    if pp <= 1 or v <= 1 or schedule != "interleaved-1f1b":
        return 1.0
    per_round = m // max(1, m // pp)
    steady = max(0, m * v - (_interleaved_warmup(pp, v, m, rank) + 1))
    return min(v, max(1, math.ceil(steady / per_round))) / v


def bubble_slots(schedule: str, pp: int, v: int, flops_f: float = 1.0, flops_b: float = 1.0,
                 flops_w: float = 1.0) -> float:
    """Idle time per step, in micro-batch (forward + backward) times of the slowest rank."""
    if pp <= 1:
        return 0.0
    if schedule == "interleaved-1f1b":
        return (pp - 1) / v
    if schedule == "zero-bubble":
        total = flops_f + flops_b + flops_w
        return (pp - 1) * max(0.0, flops_f + flops_b - 2 * flops_w) / (v * total) if total else 0.0
    return float(pp - 1)
