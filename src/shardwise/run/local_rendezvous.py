"""The rendezvous of a single-node launch: one store, listening on the loopback interface only.

torch's c10d rendezvous (what torchrun uses) hosts its TCPStore on every interface whatever host
it is given, keeps its state there as a pickle the agent loads, and opens a second store for the
workers, also on every interface: anyone who reaches either port could make the agent run code as
the user. A local launch has one node, so it needs no rendezvous protocol: this handler answers
"node 0 of 1" and gives the agent and its workers one TCPStore whose listening socket is bound to
127.0.0.1 before the store takes it over (`master_listen_fd`). Nothing in that store is
unpickled. The workers bind their own sockets to loopback too (`parallel.distributed`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

#: the `rdzv_backend` name `run.agent` launches with
BACKEND = "shardwise-local"
LOOPBACK = "127.0.0.1"


def loopback_store(timeout_s: float) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only, on a free port (`.port`)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False,
                             timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


class LocalRendezvous(RendezvousHandler):
    """Node 0 of a one-node job, every round; the workers share the agent's loopback store."""

    def __init__(self, run_id: str, timeout_s: float) -> None:
        self._run_id = run_id
        self._store: dist.TCPStore | None = loopback_store(timeout_s)
        self._round = 0
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """The workers use this store (TORCHELASTIC_USE_AGENT_STORE): keys they set there
        outlive an elastic restart of the workers (`resilience.attempt` counts starts in it)."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            raise RuntimeError("the local rendezvous was shut down")
        # each round's agent keys under their own prefix, as torch's c10d rendezvous does
        agent_store = dist.PrefixStore(f"/shardwise/agent/round_{self._round}", self._store)
        self._round += 1
        return RendezvousInfo(agent_store, rank=0, world_size=1,
                              bootstrap_store_info=RendezvousStoreInfo(LOOPBACK, self._store.port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody else ever joins

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None  # the server stops when the agent lets go of it too
        return True


def _create(params: RendezvousParameters) -> LocalRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous starts one node; max_nodes is "
                         f"{params.max_nodes}")
    return LocalRendezvous(params.run_id, float(params.get_as_int("timeout", 900) or 900))


rendezvous_handler_registry.register(BACKEND, _create)
