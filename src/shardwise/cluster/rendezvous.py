"""torch's c10d rendezvous, with the workers' store pinned to the rendezvous store itself.

torch's c10d handler gives the workers a store of their own, hosted by the agent that is rank 0
of the current rendezvous round (ranks follow the nodes' names and process ids, not the
endpoint). When that node is lost and a replacement joins, rank 0 may move: the other agents keep
the old rank 0's address (cached from the first round) or a new server starts empty, so the
workers lose what they keep in that store across restarts (`resilience.attempt` counts launch
attempts there) and a replaced node cannot be resumed from. Here the workers use the rendezvous
store on the endpoint, which the node that hosts it (`--rdzv-conf is_host=true`) keeps for the
life of the job: losing any other node leaves it intact; losing that node ends the job
(`cluster.node` says so).

Registered as `BACKEND`; `cluster.node` runs a `--rdzv-backend c10d` command through it.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "shardwise-c10d"
#: torch's default c10d port when the endpoint has none
DEFAULT_PORT = 29400


class PinnedStoreRendezvous(RendezvousHandler):
    """torch's c10d handler, whose every round hands the workers the rendezvous store."""

    def __init__(self, inner: RendezvousHandler, host: str, port: int) -> None:
        self._inner = inner
        self._store_info = RendezvousStoreInfo(host, port)

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        return RendezvousInfo(info.store, info.rank, info.world_size, self._store_info)

    @property
    def use_agent_store(self) -> bool:
        """The workers connect to the rendezvous store as clients (TORCHELASTIC_USE_AGENT_STORE)."""
        return True

    def get_backend(self) -> str:
        return BACKEND

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create(params: RendezvousParameters) -> PinnedStoreRendezvous:
    c10d = RendezvousParameters("c10d", params.endpoint, params.run_id, params.min_nodes,
                                params.max_nodes, params.local_addr, **params.config)
    backend, store = create_backend(c10d)
    host, port = parse_rendezvous_endpoint(c10d.endpoint, default_port=DEFAULT_PORT)
    return PinnedStoreRendezvous(create_handler(store, backend, c10d), host, port)


rendezvous_handler_registry.register(BACKEND, _create)
