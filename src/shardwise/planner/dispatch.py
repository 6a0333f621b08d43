"""Expert parallel's token traffic: how many copies of a token its dispatch sends, and where.

A token routed to `top_k` experts is sent by a plain all-to-all (Megatron's alltoall dispatcher,
shardwise's) once per expert: top_k copies, spread over the expert-parallel group's ranks as the
experts are. A deduplicating dispatcher (DeepEP's normal kernels, DeepSeek-V3 §3.2.2) sends it
once per destination rank inside a node and once per destination node across nodes, where it is
fanned out over NVLink: as many copies as distinct ranks, and distinct nodes over the network.
How many that is depends on the routing (`CostParams.ep_routing`): "uniform", independent
top-k choices over all experts (what a balanced router approaches); "consecutive", the k
experts of a token adjacent ids (NeMo AutoModel's forced-balanced gate: token t takes experts
t·k ... t·k + k - 1 mod E), which a dispatcher that deduplicates sends to one or two ranks.
"""

from __future__ import annotations

import math
from functools import lru_cache

#: how expert parallel moves tokens (`CostParams.ep_dispatch`)
DISPATCHERS = ("all_to_all", "deduplicated")
#: which experts a token's top-k are (`CostParams.ep_routing`)
ROUTINGS = ("uniform", "consecutive")


@lru_cache(maxsize=4096)
def distinct_groups(experts: int, top_k: int, groups: int, routing: str) -> float:
    """Expected number of the `groups` equal blocks of consecutive expert ids (ranks or nodes)
    that a token's `top_k` experts fall in."""
    if groups <= 1:
        return 1.0
    block = experts / groups
    if routing == "consecutive":
        starts = [(t * top_k) % experts for t in range(experts // math.gcd(experts, top_k))]
        return sum(math.floor((s + top_k - 1) / block) - math.floor(s / block) + 1
                   for s in starts) / len(starts)
    # uniform: 1 - P(no expert in a block) = 1 - C(E - b, k) / C(E, k), per block
    missing = math.comb(experts - int(block), top_k) / math.comb(experts, top_k)
    return groups * (1.0 - missing)


def token_copies(experts: int, top_k: int, ep: int, nodes: int, dispatcher: str,
                 routing: str) -> tuple[float, float]:
    """(copies of a token sent to ranks, copies sent across nodes) by a rank of an `ep`-wide
    group spanning `nodes` nodes, before the share that stays on the rank itself."""
    if dispatcher == "all_to_all":
        return float(top_k), float(top_k)
    return (distinct_groups(experts, top_k, ep, routing),
            distinct_groups(experts, top_k, nodes, routing))
