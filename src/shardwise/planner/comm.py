"""Communication: alpha-beta cost of each collective, placed on intra- or inter-node links.

Placement follows the mesh order `shardwise.parallel.dims` builds (Llama 3's): tp innermost, then
cp, dp_shard, dp_replicate, pp outermost; expert parallel takes consecutive ranks of cp x dp_shard
just outside tp. An axis of degree d whose inner axes hold `stride` ranks spans d x stride
consecutive ranks: inside one node when that is at most the devices per node, otherwise across
nodes with k = devices_per_node / stride members per node (1 when stride >= devices_per_node).
A group across nodes gets min(intra, k x the inter-node bandwidth per device): NCCL runs one ring
per NIC (rail-optimised fabric), and the node's NICs are shared by its devices, since every group
of the axis communicates at once.

Costs (S bytes the collective is about, N ranks, B the group's bandwidth x
`CostParams.bandwidth_efficiency`; Thakur, Rabenseifner & Gropp 2005 for the ring volumes, the
one rule in `telemetry.comm_theory.ring_fraction` that the comm tap's wire bytes also use):
    all-reduce                 2 (N-1)/N · S / B
    reduce-scatter, all-gather   (N-1)/N · S / B   (S: the unsharded size)
    all-to-all                 (N-k)/N · S / B_inter_dev + (k-1)/N · S / B_intra (S: sent per rank)
    p2p                        S / B
plus a latency from NCCL's own tuning model (`src/graph/tuning.cc`): a base latency per collective
(`CostParams.collective_latency_s`) + the ring's intra-node steps x the intra latency + its
inter-node steps x the inter latency; across many nodes NCCL switches to trees (all-reduce) or PAT
(all-gather / reduce-scatter) whose inter-node steps grow as log2(nodes), and the smaller is taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from shardwise.spec.cluster import ClusterSpec
from shardwise.telemetry.comm_theory import ring_fraction


@dataclass(frozen=True)
class Group:
    """One process group of an axis, as the links see it."""

    size: int
    nodes: int  # nodes it spans
    per_node: int  # members per node
    bandwidth: float  # bytes/s, efficiency applied
    inter_bandwidth: float  # bytes/s per device across nodes, efficiency applied
    intra_bandwidth: float
    alpha_intra: float  # s per ring step
    alpha_inter: float
    base: float  # s per collective

    @property
    def inter(self) -> bool:
        return self.nodes > 1


def group(size: int, stride: int, cluster: ClusterSpec, efficiency: float, base: float) -> Group:
    g = cluster.devices_per_node
    intra = cluster.intra_bytes_per_s * efficiency
    inter_dev = cluster.inter_bytes_per_s_per_device * efficiency
    a_in, a_out = cluster.intra.latency_us * 1e-6, cluster.inter.latency_us * 1e-6
    if size <= 1:
        return Group(1, 1, 1, intra, inter_dev, intra, a_in, a_out, base)
    if size * stride <= g:
        return Group(size, 1, size, intra, inter_dev, intra, a_in, a_out, base)
    per_node = 1 if stride >= g else max(1, g // stride)
    per_node = min(per_node, size)
    nodes = math.ceil(size / per_node)
    return Group(size, nodes, per_node, min(intra, per_node * inter_dev), inter_dev, intra,
                 a_in, a_out, base)


@lru_cache(maxsize=8192)
def cached_group(size: int, stride: int, cluster: ClusterSpec, efficiency: float,
                 base: float) -> Group:
    return group(size, stride, cluster, efficiency, base)


def _latency(grp: Group, steps: int, inter_steps: int, tree_factor: int) -> float:
    ring = grp.base + (steps - inter_steps) * grp.alpha_intra + inter_steps * grp.alpha_inter
    if not grp.inter:
        return ring
    tree = grp.base + tree_factor * ((grp.per_node - 1) * grp.alpha_intra
                                     + math.ceil(math.log2(grp.nodes)) * grp.alpha_inter)
    return min(ring, tree)


def all_reduce(nbytes: float, grp: Group) -> float:
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (_latency(grp, 2 * (n - 1), 2 * (grp.nodes - 1), 2)
            + ring_fraction("all_reduce", n) * nbytes / grp.bandwidth)


def all_gather(nbytes: float, grp: Group) -> float:
    """Also a reduce-scatter: `nbytes` is the unsharded size."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (_latency(grp, n - 1, grp.nodes - 1, 1)
            + ring_fraction("all_gather", n) * nbytes / grp.bandwidth)


reduce_scatter = all_gather


def all_to_all(nbytes: float, grp: Group) -> float:
    """`nbytes` leave each rank's buffer, 1/N of it to each member (itself included)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = grp.per_node
    off_node = (n - k) / n * nbytes / grp.inter_bandwidth if grp.inter else 0.0
    on_node = (k - 1) / n * nbytes / grp.intra_bandwidth
    return _latency(grp, n - 1, grp.nodes - 1, 1) + max(off_node, on_node)


def p2p(nbytes: float, inter: bool, cluster: ClusterSpec, efficiency: float, base: float) -> float:
    if nbytes <= 0:
        return 0.0
    if inter:
        return base + cluster.inter.latency_us * 1e-6 + nbytes / (
            cluster.inter_bytes_per_s_per_device * efficiency)
    return base + cluster.intra.latency_us * 1e-6 + nbytes / (cluster.intra_bytes_per_s * efficiency)


def exposed(comm: float, window: float, overlap: float) -> float:
    """The part of `comm` seconds not hidden behind `window` seconds of compute it can overlap
    with: at most `overlap` of it hides, and never more than the window."""
    return max(comm - min(overlap * comm, window), 0.0)


AXES = ("tp", "cp", "ep", "pp", "dp_shard", "dp_replicate")


def strides(tp: int, cp: int, dp_shard: int, dp_replicate: int) -> dict[str, int]:
    """Ranks held by the axes inside each axis (mesh order pp, dp_replicate, dp_shard, cp, tp)."""
    return {"tp": 1, "cp": tp, "ep": tp, "dp_shard": tp * cp, "dp_replicate": tp * cp * dp_shard,
            "pp": tp * cp * dp_shard * dp_replicate}
