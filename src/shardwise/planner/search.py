"""Search the layouts of a model on a cluster: the top K by predicted tokens/s among those that fit,
the best of those that do not (and why), and the smallest cluster that would fit.

Enumerated: tp (dividing heads, KV heads, the FFN widths and the vocabulary; at most the devices
per node, where NVLink is), cp (2cp dividing the sequence, each rank keeping at least
`SearchSpace.min_cp_tokens` tokens), pp (at most the blocks; uneven splits are fine), the
dp_replicate x dp_shard split of the data-parallel ranks with a ZeRO stage (dp_shard = dp,
dp/2, dp/4, dp/8, one node's worth, or 1; `SearchSpace.all_hsdp` tries every split), ep (MoE
models: dividing the experts and dp_shard x cp, up to `max_ep`), the schedule and v, the
micro-batch size (powers of two dividing the sequences per data-parallel rank, and that count
itself), activation recompute, and on a cluster split into pods (`[topology]`) the mesh order
(`orders`: pipeline or data parallel outermost). Pruned early, with a count per reason: products that do not
divide the world or the batch, combinations shardwise refuses (`plan.layout`), and
degree choices whose model state alone (`memory.state_lower_bound`) exceeds the device. Within
one choice of degrees, schedule and micro-batch, recompute is tried none -> selective -> full and
the first that fits is kept (more recompute only costs time); a larger micro-batch is tried only
while a smaller one fits.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from shardwise.planner.cost import DEFAULT_PARAMS, CostParams, Prediction, predict, predict_memory
from shardwise.planner.layout import RECOMPUTE, Batch, Layout
from shardwise.planner.memory import state_lower_bound
from shardwise.planner.models import ModelDims
from shardwise.spec.cluster import GIB, ClusterSpec


@dataclass(frozen=True)
class SearchSpace:
    max_tp: int = 0  # 0: the devices per node
    max_cp: int = 16
    min_cp_tokens: int = 1024
    max_v: int = 8
    max_micro_batch: int = 64
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
    recompute: tuple[str, ...] = RECOMPUTE
    max_ep: int = 64
    all_hsdp: bool = False  # every dp_replicate x dp_shard split, not only the usual ones
    ac_every: int = 2
    rejected: int = 5  # how many of the best layouts that do not fit to report


@dataclass
class PlanResult:
    model: ModelDims
    cluster: ClusterSpec
    batch: Batch
    params: CostParams
    feasible: list[Prediction]  # best first
    rejected: list[Prediction]  # the best that do not fit, best first (each has .reason)
    closest: list[tuple[float, Layout]]  # (model-state bytes, layout) pruned, least memory first
    pruned: Counter = field(default_factory=Counter)
    evaluated: int = 0
    elapsed_s: float = 0.0

    def top(self, k: int) -> list[Prediction]:
        return self.feasible[:k]

    def find(self, **degrees: object) -> list[Prediction]:
        """The feasible predictions whose layout has these field values (best first)."""
        return [p for p in self.feasible
                if all(getattr(p.layout, k) == v for k, v in degrees.items())]


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _tp_ok(model: ModelDims, tp: int) -> bool:
    if tp == 1:
        return True
    if model.opaque or not model.supports_tp:
        return False
    return all(not n or n % tp == 0 for n in (model.heads, model.kv, model.ffn, model.expert_ffn,
                                                model.vocab))


def _schedules(pp: int, model: ModelDims, space: SearchSpace) -> list[tuple[str, int]]:
    if pp == 1:
        return [("none", 1)]
    out = []
    for schedule in space.schedules:
        if schedule in ("gpipe", "1f1b"):
            out.append((schedule, 1))
        elif schedule == "interleaved-1f1b":
            out.extend((schedule, v) for v in range(2, space.max_v + 1) if pp * v <= model.layers)
        elif schedule == "zero-bubble" and 2 * pp <= model.layers:
            out.append((schedule, 2))
    return out


def degree_choices(model: ModelDims, cluster: ClusterSpec, batch: Batch, space: SearchSpace,
                   pruned: Counter) -> Iterator[Layout]:
    """Every (dp_replicate, dp_shard, zero, tp, cp, pp, ep) that shardwise's rules allow, as a
    Layout with micro_batch 1, no schedule and no recompute."""
    world = cluster.world
    max_tp = space.max_tp or cluster.devices_per_node
    for tp in divisors(world):
        if tp > max_tp:
            pruned[f"tp above {max_tp} (the devices per node)"] += 1
            continue
        if not _tp_ok(model, tp):
            pruned["tp does not divide heads / KV heads / FFN / vocabulary, or no TP plan"] += 1
            continue
        sp = tp > 1 and batch.seq_len % tp == 0
        for cp in divisors(world // tp):
            if cp > 1 and (model.opaque or cp > space.max_cp or batch.seq_len % (2 * cp)
                           or batch.seq_len // cp < space.min_cp_tokens):
                pruned["cp beyond the sequence (2cp must divide it, min tokens per rank)"] += 1
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > 1 and (model.opaque or not model.supports_pp or pp > model.layers):
                    pruned["pp above the blocks, or no pipeline plan"] += 1
                    continue
                dp = world // (tp * cp * pp)
                if batch.global_batch % dp:
                    pruned[f"global batch {batch.global_batch} not divisible by dp"] += 1
                    continue
                for shard in _shard_choices(dp, tp * cp, cluster.devices_per_node, space):
                    zeros = (0,) if shard == 1 else (1, 2, 3)
                    if world == 1:
                        zeros = (0, 2, 3)
                    for zero in zeros:
                        # DDP / ZeRO-1 under tp or pp: the distributed optimizer
                        # (parallel/flat_dp.py), which does not take ep yet
                        flat = zero in (0, 1) and dp * cp > 1 and (tp > 1 or pp > 1)
                        eps = [1]
                        if model.moe and not model.opaque:
                            eps += [e for e in divisors(model.experts) if 1 < e <= space.max_ep
                                    and (shard * cp) % e == 0]
                        if flat and len(eps) > 1:
                            pruned["ep with DDP / ZeRO-1 under tp or pp (not yet)"] += len(eps) - 1
                            eps = [1]
                        for ep in eps:
                            for order in orders(cluster, pp, dp):
                                yield Layout(dp_replicate=dp // shard, dp_shard=shard, zero=zero,
                                             tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=sp,
                                             ac_every=space.ac_every, order=order)


def orders(cluster: ClusterSpec, pp: int, dp: int) -> tuple[str, ...]:
    """Mesh orders to try: shardwise's (pipeline outermost); and, where the cluster is split into
    pods and both pipeline and data parallelism cross nodes, Llama 3's (data parallel outermost,
    so that the axis that tolerates latency is the one that crosses the pods)."""
    if pp > 1 and dp > 1 and cluster.pod_devices < cluster.world:
        return ("tp-cp-dp-pp", "tp-cp-pp-dp")
    return ("tp-cp-dp-pp",)


def _shard_choices(dp: int, inner: int, per_node: int, space: SearchSpace) -> list[int]:
    """dp_shard values tried: all of dp (plain FSDP), dp / 2, 4, 8 replicated (HSDP), the
    shard group that fills exactly one node, and 1 (DDP); every divisor when
    `space.all_hsdp`."""
    if space.all_hsdp:
        return divisors(dp)
    wanted = {dp, 1, *(dp // r for r in (2, 4, 8) if dp % r == 0)}
    if inner < per_node and per_node % inner == 0 and dp % (per_node // inner) == 0:
        wanted.add(per_node // inner)
    return sorted(wanted)


def _micro_batches(layout: Layout, batch: Batch, space: SearchSpace) -> list[int]:
    per_rank = batch.global_batch // layout.dp
    return [b for b in divisors(per_rank)
            if b <= space.max_micro_batch and (b & (b - 1) == 0 or b == per_rank)]


def _pipeline_ok(layout: Layout, m: int) -> bool:
    if layout.pp == 1 or layout.schedule == "gpipe":
        return True
    if m < layout.pp:
        return False
    return not (layout.v > 1 and m % layout.pp)


def search(model: ModelDims, cluster: ClusterSpec, batch: Batch,
           params: CostParams = DEFAULT_PARAMS, space: SearchSpace = SearchSpace()) -> PlanResult:
    """All layouts of `model` on `cluster` for `batch`, predicted; see the module docstring."""
    start = time.perf_counter()
    pruned: Counter = Counter()
    feasible: list[Prediction] = []
    rejected: list[tuple[float, int, Prediction]] = []  # min-heap on tokens/s
    closest: list[tuple[float, int, Layout]] = []  # max-heap on -bytes
    evaluated = 0
    tie = itertools.count()
    capacity = cluster.memory_bytes
    recomputable = model.supports_recompute and not model.opaque
    for base in degree_choices(model, cluster, batch, space, pruned):
        sizes = _micro_batches(base, batch, space)
        smallest = dataclasses.replace(base, micro_batch=sizes[-1] if sizes else 1)
        bound = state_lower_bound(model, smallest, batch, params)
        if bound > capacity:
            pruned["model state alone exceeds the device"] += 1
            near = (-bound, next(tie), base)
            (heapq.heappush if len(closest) < space.rejected else heapq.heappushpop)(closest, near)
            continue
        for schedule, v in _schedules(base.pp, model, space):
            for mb in sizes:
                m = batch.global_batch // (base.dp * mb)
                shaped = dataclasses.replace(base, schedule=schedule, v=v, micro_batch=mb)
                if not _pipeline_ok(shaped, m):
                    pruned["too few micro-batches for the schedule"] += 1
                    continue
                fitted = False
                for i, recompute in enumerate(space.recompute if recomputable else ("none",)):
                    layout = dataclasses.replace(shaped, recompute=recompute)
                    # memory first (cheap); time only for what fits, and for the least-recompute
                    # variant of what does not (a candidate for the best rejected)
                    if i and predict_memory(layout, model, batch, params,
                                            cluster.cluster.device)[0].total > capacity:
                        continue
                    pred = predict(layout, model, cluster, batch, params)
                    evaluated += 1
                    if pred.fits:
                        feasible.append(pred)
                        fitted = True
                        break
                    item = (pred.tokens_per_s, next(tie), pred)
                    if len(rejected) < space.rejected:
                        heapq.heappush(rejected, item)
                    elif item[0] > rejected[0][0]:
                        heapq.heapreplace(rejected, item)
                if not fitted:
                    break  # a larger micro-batch needs more memory still
    feasible.sort(key=lambda p: -p.tokens_per_s)
    best = feasible[0].tokens_per_s if feasible else 0.0
    worse_rejected = sorted((p for _, _, p in rejected), key=lambda p: -p.tokens_per_s)
    if feasible:  # report those that would have beaten a feasible layout first
        worse_rejected.sort(key=lambda p: (p.tokens_per_s <= best, -p.tokens_per_s))
    return PlanResult(model=model, cluster=cluster, batch=batch, params=params, feasible=feasible,
                      rejected=worse_rejected,
                      closest=sorted(((-b, lo) for b, _, lo in closest), key=lambda t: t[0]),
                      pruned=pruned, evaluated=evaluated, elapsed_s=time.perf_counter() - start)


def any_fits(model: ModelDims, cluster: ClusterSpec, batch: Batch,
             params: CostParams = DEFAULT_PARAMS, space: SearchSpace = SearchSpace()) -> bool:
    """Whether some layout fits (memory only, most memory-frugal choices first)."""
    pruned: Counter = Counter()
    capacity = cluster.memory_bytes
    for base in degree_choices(model, cluster, batch, space, pruned):
        sizes = _micro_batches(base, batch, space)
        if not sizes or state_lower_bound(model, dataclasses.replace(base, micro_batch=sizes[-1]),
                                          batch, params) > capacity:
            continue
        recompute = space.recompute[-1] if model.supports_recompute and not model.opaque else "none"
        for schedule, v in _schedules(base.pp, model, space):
            for mb in sizes:
                m = batch.global_batch // (base.dp * mb)
                layout = dataclasses.replace(base, schedule=schedule, v=v, micro_batch=mb,
                                             recompute=recompute)
                if not _pipeline_ok(layout, m):
                    continue
                mem, _ = predict_memory(layout, model, batch, params, cluster.cluster.device)
                if mem.total <= capacity:
                    return True
                break  # larger micro-batches need more
    return False


def smallest_cluster(model: ModelDims, cluster: ClusterSpec, batch: Batch,
                     params: CostParams = DEFAULT_PARAMS, space: SearchSpace = SearchSpace(),
                     max_devices: int = 2**21) -> int | None:
    """The fewest nodes (more than `cluster.nodes`) at which some layout fits: doubling until one
    does, then bisecting back (divisibility of the batch can make the answer not monotone; the
    count returned does fit). None below `max_devices` devices."""
    lo, hi = cluster.nodes, cluster.nodes * 2
    while not any_fits(model, cluster.with_nodes(hi), batch, params, space):
        lo, hi = hi, hi * 2
        if hi * cluster.devices_per_node > max_devices:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if any_fits(model, cluster.with_nodes(mid), batch, params, space):
            hi = mid
        else:
            lo = mid
    return hi


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"
