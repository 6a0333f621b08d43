"""#26 item 12, the pieces (no process group): the local launch's rendezvous store listens on
127.0.0.1 only and holds nothing pickled, and a single-node group's gloo/NCCL interface is the
loopback one for as long as the group lives. The whole run: tests/e2e/test_security.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardwise.parallel.distributed import bind_to_loopback, loopback_interface, shutdown
from shardwise.run.local_rendezvous import BACKEND, LocalRendezvous
from tests.support.sockets import listeners

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc (Linux)")


def test_the_local_rendezvous_listens_on_loopback_only():
    """torch's c10d rendezvous listened on *:PORT (even for localhost:0), twice."""
    before = {(s.address, s.port) for s in listeners({os.getpid()})}
    handler = LocalRendezvous("job", timeout_s=30)
    opened = [s for s in listeners({os.getpid()}) if (s.address, s.port) not in before]
    assert len(opened) == 1 and opened[0].loopback, [str(s) for s in opened]
    first, second = handler.next_rendezvous(), handler.next_rendezvous()  # a restart's round
    for info in (first, second):
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert info.bootstrap_store_info.master_port == opened[0].port
    first.store.set("torchelastic/role_info/0", b"{}")  # each round's agent keys apart
    assert not second.store.check(["torchelastic/role_info/0"])
    assert handler.get_backend() == BACKEND and handler.use_agent_store
    assert handler.num_nodes_waiting() == 0 and handler.shutdown()


def test_a_single_node_group_binds_gloo_and_nccl_to_loopback_until_shutdown(monkeypatch):
    """A cluster environment's GLOO_SOCKET_IFNAME=eth0 would have gloo listen on the network;
    while a single-node group lives it is the loopback interface, and afterwards the user's
    choice again (a notebook that called shardwise.train keeps its environment)."""
    name = loopback_interface()
    assert name in ("lo", "lo0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    bind_to_loopback()
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == name
    shutdown()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0" and "NCCL_SOCKET_IFNAME" not in os.environ


def test_loopback_only_when_the_launcher_says_every_rank_is_here(monkeypatch):
    """A launcher that does not set LOCAL_WORLD_SIZE (srun with RANK/WORLD_SIZE of its own) may
    have ranks on other nodes: gloo is left where it would listen, or they could not connect."""
    from shardwise.parallel.distributed import all_ranks_here

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert all_ranks_here(1) and not all_ranks_here(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert all_ranks_here(4) and not all_ranks_here(8)
