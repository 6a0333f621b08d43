"""Communication: alpha-beta cost of each collective, placed on intra- or inter-node links.

Placement follows the layout's mesh order (`Layout.order`, inside out): "tp-cp-dp-pp", the one
`shardwise.parallel.dims` builds (and Megatron's): tp innermost, then cp, dp_shard, dp_replicate,
pp outermost; or "tp-cp-pp-dp", Llama 3's [TP, CP, PP, DP] ("The Llama 3 Herd of Models"
§3.3.2: data parallel outermost, so its traffic, which tolerates latency, is the one that
crosses pods). Expert parallel takes consecutive ranks of cp x dp_shard just outside tp. An axis
of degree d whose inner axes hold `stride` ranks spans d x stride consecutive ranks: inside one
node when that is at most the devices per node, otherwise across nodes with k =
devices_per_node / stride members per node (1 when stride >= devices_per_node). A group across
nodes gets min(intra, k x the inter-node bandwidth per device): NCCL runs one ring per NIC
(rail-optimised fabric), and the node's NICs are shared by its devices, since every group of the
axis communicates at once. A group across pods (`[topology] pod_nodes`) with j members per pod
gets at most j x the inter-node bandwidth per device / the pod oversubscription: every group of
the axis crosses the oversubscribed layer at once, j NICs per pod at a time. On a rail-optimised fabric
(`[topology] rails`) a group whose members share their local index (its stride a multiple of the
devices per node) stays on one rail: said in the placement, not a different bandwidth.

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
from functools import cached_property, lru_cache

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
    pods: int = 1  # pods it spans
    per_pod: int = 0  # members per pod (0: all in one)
    oversubscription: float = 1.0  # of the layer between pods, when it spans several
    rail: bool = False  # on a rail-optimised fabric, its members share a local index: one rail

    @property
    def inter(self) -> bool:
        return self.nodes > 1

    @cached_property
    def link(self) -> str:
        """Where its traffic runs, in words."""
        if self.size <= 1:
            return "none"
        if not self.inter:
            return "NVLink (one node)"
        rail = ", one rail" if self.rail else ""
        if self.pods > 1:
            return (f"network across {self.pods} pods (1:{self.oversubscription:g}), "
                    f"{self.per_pod} per pod{rail}")
        return f"network, {self.nodes} nodes{rail}"

    @cached_property
    def pod_bound(self) -> bool:
        """Whether the oversubscribed layer between pods is what limits its bandwidth."""
        return self.pods > 1 and self.per_pod * self.inter_bandwidth / self.oversubscription \
            < min(self.intra_bandwidth, self.per_node * self.inter_bandwidth)


def group(size: int, stride: int, cluster: ClusterSpec, efficiency: float, base: float,
          outer: tuple[int, int] = (1, 0)) -> Group:
    """The group of `size` ranks `stride` apart, and with `outer` = (n, s) that block of ranks
    repeated n times s apart (s at least the block's span): FSDP's dp_shard x cp under the
    data-parallel-outermost order, where pp sits between the two."""
    reps, far = outer
    total = size * reps
    g = cluster.devices_per_node
    intra = cluster.intra_bytes_per_s * efficiency
    inter_dev = cluster.inter_bytes_per_s_per_device * efficiency
    a_in, a_out = cluster.intra.latency_us * 1e-6, cluster.inter.latency_us * 1e-6
    if total <= 1:
        return Group(1, 1, 1, intra, inter_dev, intra, a_in, a_out, base)
    span = size * stride if reps == 1 else (reps - 1) * far + size * stride
    if span <= g:
        return Group(total, 1, total, intra, inter_dev, intra, a_in, a_out, base)

    def within(block: int) -> int:
        """Members in `block` consecutive devices aligned with the group's first."""
        inner = min(size, max(1, block // stride)) if size * stride > block else size
        return inner * (min(reps, max(1, block // far)) if reps > 1 else 1)

    per_node = within(g)
    nodes = math.ceil(total / per_node)
    bandwidth = min(intra, per_node * inter_dev)
    # its members share a local index when every stride between them is whole nodes
    rail = cluster.topology.rails and (size == 1 or stride % g == 0) and (reps == 1 or far % g == 0)
    pod = cluster.pod_devices
    if span <= pod:
        return Group(total, nodes, per_node, bandwidth, inter_dev, intra, a_in, a_out, base,
                     rail=rail)
    per_pod = within(pod)
    pods = math.ceil(total / per_pod)
    over = cluster.topology.pod_oversubscription
    return Group(total, nodes, per_node, min(bandwidth, per_pod * inter_dev / over), inter_dev,
                 intra, a_in, a_out, base, pods, per_pod, over, rail)


@lru_cache(maxsize=8192)
def cached_group(size: int, stride: int, cluster: ClusterSpec, efficiency: float,
                 base: float, outer: tuple[int, int] = (1, 0)) -> Group:
    return group(size, stride, cluster, efficiency, base, outer)


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


def all_to_all(nbytes: float, grp: Group, network_bytes: float | None = None) -> float:
    """`nbytes` leave each rank's buffer, 1/N of it to each member (itself included), of which
    `network_bytes` cross nodes (default: the members' share on other nodes)."""
    n = grp.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    k = grp.per_node
    if network_bytes is None:
        network_bytes = (n - k) / n * nbytes
    off_node = network_bytes / grp.inter_bandwidth if grp.inter else 0.0
    on_node = (k - 1) / n * nbytes / grp.intra_bandwidth
    return _latency(grp, n - 1, grp.nodes - 1, 1) + max(off_node, on_node)


def p2p(nbytes: float, inter: bool, cluster: ClusterSpec, efficiency: float, base: float) -> float:
    if nbytes <= 0:
        return 0.0
    if inter:
        return base + cluster.inter.latency_us * 1e-6 + nbytes / (
            cluster.inter_bytes_per_s_per_device * efficiency)
    return base + cluster.intra.latency_us * 1e-6 + nbytes / (cluster.intra_bytes_per_s * efficiency)


def p2p_in(nbytes: float, grp: Group, inter: bool) -> float:
    """Send/receive between neighbours of `grp` (a pipeline group): one NIC's bandwidth across
    nodes, no more than the group's share of the pods' uplinks when it spans pods."""
    if nbytes <= 0:
        return 0.0
    if not inter:
        return grp.base + grp.alpha_intra + nbytes / grp.intra_bandwidth
    bandwidth = min(grp.inter_bandwidth, grp.bandwidth) if grp.pods > 1 else grp.inter_bandwidth
    return grp.base + grp.alpha_inter + nbytes / bandwidth


def exposed(comm: float, window: float, overlap: float) -> float:
    """The part of `comm` seconds not hidden behind `window` seconds of compute it can overlap
    with: at most `overlap` of it hides, and never more than the window."""
    return max(comm - min(overlap * comm, window), 0.0)


def pipelined(comm: float, window: float, chunks: int) -> float:
    """The exposed part of a collective split into `chunks` steps that alternate with the chunks
    of the matmul next to it (Megatron / Transformer Engine's TP comm overlap: an all-gather or
    reduce-scatter over tp ranks as tp - 1 ring exchanges, each behind one GEMM chunk): the
    first step (all-gather) or the last (reduce-scatter) has nothing to hide behind; the rest
    hide while there is compute."""
    if chunks <= 1:
        return comm
    first = comm / chunks
    return first + max(0.0, comm - first - window)


AXES = ("tp", "cp", "ep", "pp", "dp_shard", "dp_replicate")

#: mesh orders, inside out (`Layout.order`)
ORDERS = {"tp-cp-dp-pp": ("tp", "cp", "dp_shard", "dp_replicate", "pp"),
          "tp-cp-pp-dp": ("tp", "cp", "pp", "dp_shard", "dp_replicate")}


def strides(tp: int, cp: int, dp_shard: int, dp_replicate: int, pp: int = 1,
            order: str = "tp-cp-dp-pp") -> dict[str, int]:
    """Ranks held by the axes inside each axis, for a mesh order (`ORDERS`); expert parallel
    sits just outside tp."""
    degrees = {"tp": tp, "cp": cp, "dp_shard": dp_shard, "dp_replicate": dp_replicate, "pp": pp}
    out, inner = {}, 1
    for axis in ORDERS[order]:
        out[axis] = inner
        inner *= degrees[axis]
    out["ep"] = tp
    return out


@lru_cache(maxsize=4096)
def mesh_groups(tp: int, cp: int, dp_shard: int, dp_replicate: int, pp: int, ep: int,
                order: str, cluster: ClusterSpec, eff: float,
                base: float) -> tuple[dict[str, Group], bool]:
    """Every process group a layout communicates on, by role (`tp`, `cp`, `ep`, `pp`, `shard`:
    dp_shard x cp, FSDP's; `shard_experts`; `replicate`: HSDP's; `dp`: all data parallel), and
    whether pipeline neighbours sit on different nodes."""
    st = strides(tp, cp, dp_shard, dp_replicate, pp, order)
    nd = dp_shard * cp
    ne = max(1, nd // ep)
    dp = dp_shard * dp_replicate
    # under the data-parallel-outermost order, dp_shard x cp is not contiguous when pp sits
    # between them: cp's block of ranks, repeated dp_shard times at dp_shard's stride
    shard = cached_group(nd, st["cp"], cluster, eff, base) if order == "tp-cp-dp-pp" else \
        cached_group(cp, st["cp"], cluster, eff, base, (dp_shard, st["dp_shard"]))
    groups = {
        "tp": cached_group(tp, 1, cluster, eff, base),
        "cp": cached_group(cp, st["cp"], cluster, eff, base),
        "ep": cached_group(ep, st["ep"], cluster, eff, base),
        "pp": cached_group(pp, st["pp"], cluster, eff, base),
        "shard": shard,
        "shard_experts": cached_group(ne, st["ep"] * ep, cluster, eff, base),
        "replicate": cached_group(dp_replicate, st["dp_replicate"], cluster, eff, base),
        "dp": cached_group(dp, st["dp_shard"], cluster, eff, base),
    }
    return groups, pp * st["pp"] > cluster.devices_per_node
