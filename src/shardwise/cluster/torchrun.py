"""The exact torchrun command of one node of a multi-node job (c10d rendezvous).

The command runs `shardwise train` unchanged under torchrun. Preemption needs two torchrun
options: `--signals-to-handle` adds the preemption signals (SIGUSR1 would otherwise kill the
agent and orphan the workers) and `--shutdown-timeout` gives the workers the grace period to
commit their checkpoint before the agent kills them. `--rdzv-conf is_host=true|false` says which
agent hosts the rendezvous store (the node the endpoint names): left to torch, every agent whose
machine matches the endpoint tries to, and the first to bind the port wins, so losing "some other
node" could end the job. `--exec` and the Slurm job run the same options through
`shardwise.cluster.node` (torchrun's entry point, with the store's loss said in one paragraph).
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shardwise.errors import UserError, show
from shardwise.resilience.preempt import agent_signals
from shardwise.spec.runspec import RunSpec

#: the file a multi-node launch writes the resolved spec to, in the run directory
JOB_SPEC = "job.toml"


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """`HOST:PORT` or `[IPv6]:PORT`, with a port in 1..65535."""
        host, sep, port_text = text.strip().rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        port = int(port_text) if port_text.isdigit() else -1
        if not sep or not host or not 0 < port < 65536 or any(c.isspace() for c in host):
            raise UserError(f"--rdzv-endpoint {show(text, 60)} is not HOST:PORT. Give the "
                            "address of the first node and a free TCP port every node can reach, "
                            "e.g. --rdzv-endpoint node001:29400 (or [fe80::1]:29400).")
        return cls(host, port)

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_local(self) -> bool:
        """True when the endpoint is this machine: every "node" then runs here (a test, a
        workstation), so a local run directory is shared by all of them."""
        if self.host in ("localhost", socket.gethostname(), socket.getfqdn()):
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def torchrun_executable() -> str:
    """The torchrun of this Python environment (the nodes must run the same one)."""
    beside = Path(sys.executable).parent / "torchrun"
    return str(beside) if beside.exists() else "torchrun"


def check_counts(nnodes: int, nproc_per_node: int) -> None:
    if nnodes < 1:
        raise UserError(f"--nnodes/--nodes {nnodes}: a job needs at least one node.")
    if nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {nproc_per_node}: every node runs at least one "
                        "worker (one per GPU; on CPU, one or a few per machine).")


def node_agent(run_dir: Path | str) -> list[str]:
    """What runs torchrun's options under `--exec` and Slurm: `python -m shardwise.cluster.node`
    (torchrun's own entry point; the run directory is where it leaves its marker)."""
    return [sys.executable, "-m", "shardwise.cluster.node", "--run-dir", str(run_dir)]


def torchrun_args(spec: RunSpec, *, nnodes: int, nproc_per_node: int, endpoint: str,
                  rdzv_id: str, is_host: str, agent: Sequence[str] = ()) -> list[str]:
    """torchrun's own options (everything before the training module), after `agent` (default:
    the torchrun executable). `is_host` ("true", "false", or a shell expression for Slurm) says
    whether this node's agent hosts the rendezvous store."""
    failure = spec.failure
    # no --node-rank: torchrun ignores it under c10d (and says so); here it decides is_host
    args = [*(agent or [torchrun_executable()]), "--nnodes", str(nnodes), "--nproc-per-node",
            str(nproc_per_node)]
    return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={is_host}",
            "--max-restarts", str(failure.max_restarts),
            "--signals-to-handle", agent_signals(failure.preempt_signals),
            "--shutdown-timeout", str(max(1, round(failure.preempt_grace_s)))]


def hosts_store(endpoint: Endpoint, nnodes: int, node_rank: int | None) -> bool:
    """Whether this node hosts the rendezvous store: node rank 0 when the rank is given, else
    whether the endpoint names this machine. All nodes on one machine (a loopback endpoint)
    would each claim it, so there the rank is required."""
    if nnodes == 1:
        return True
    if node_rank is not None:
        return node_rank == 0
    if nnodes > 1 and endpoint.is_local:
        raise UserError(f"--rdzv-endpoint {endpoint} is this machine, so every node of this "
                        f"{nnodes}-node job runs here and each would claim the rendezvous store: "
                        "give each its --node-rank (0 for the one that hosts the store, then 1, "
                        f"2, ... {nnodes - 1}).")
    return endpoint.is_local


def train_args(run_dir: Path, overrides: Sequence[str] = ()) -> list[str]:
    """`-m shardwise train ...`: resume the run in RUN_DIR if one was started there (a requeued
    or re-launched job; `overrides` then change its saved spec, e.g. run.steps to extend it),
    else start it from RUN_DIR/job.toml (which has the overrides in it already)."""
    from shardwise.run.rundir import SPEC_FILE

    if (run_dir / SPEC_FILE).exists():
        changes = [a for o in overrides if not o.startswith("run.dir=") for a in ("--set", o)]
        return ["-m", "shardwise", "train", "--resume", str(run_dir), *changes]
    return ["-m", "shardwise", "train", str(run_dir / JOB_SPEC)]


def node_command(spec: RunSpec, run_dir: Path, *, nnodes: int, nproc_per_node: int,
                 endpoint: Endpoint, node_rank: int | None, overrides: Sequence[str] = (),
                 agent: Sequence[str] = ()) -> list[str]:
    """One node's full command line: `agent` (default torchrun) with torchrun's options, then
    `-m shardwise train ...`."""
    check_counts(nnodes, nproc_per_node)
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes "
                        f"{nnodes}.")
    is_host = "true" if hosts_store(endpoint, nnodes, node_rank) else "false"
    return [*torchrun_args(spec, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           endpoint=str(endpoint), rdzv_id=rdzv_id(run_dir), is_host=is_host,
                           agent=agent), *train_args(run_dir, overrides)]


def rdzv_id(run_dir: Path) -> str:
    """The same on every node that names the same run directory."""
    return f"shardwise-{run_dir.name}"


def render(command: list[str]) -> str:
    return shlex.join(command)
