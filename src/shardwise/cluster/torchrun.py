"""The exact torchrun command of one node of a multi-node job (c10d rendezvous).

The command runs `shardwise train` unchanged under torchrun. Preemption needs two torchrun
options: `--signals-to-handle` adds the preemption signals (SIGUSR1 would otherwise kill the
agent and orphan the workers) and `--shutdown-timeout` gives the workers the grace period to
commit their checkpoint before the agent kills them.
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


def torchrun_args(spec: RunSpec, *, nnodes: int, nproc_per_node: int, endpoint: str,
                  rdzv_id: str, node_rank: int | None = None) -> list[str]:
    """torchrun's own options (everything before the training module)."""
    failure = spec.failure
    args = [torchrun_executable(), "--nnodes", str(nnodes), "--nproc-per-node",
            str(nproc_per_node)]
    if node_rank is not None:
        args += ["--node-rank", str(node_rank)]
    return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--max-restarts", str(failure.max_restarts),
            "--signals-to-handle", agent_signals(failure.preempt_signals),
            "--shutdown-timeout", str(max(1, round(failure.preempt_grace_s)))]


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
                 endpoint: Endpoint, node_rank: int | None,
                 overrides: Sequence[str] = ()) -> list[str]:
    check_counts(nnodes, nproc_per_node)
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} for --nnodes "
                        f"{nnodes}.")
    return [*torchrun_args(spec, nnodes=nnodes, nproc_per_node=nproc_per_node,
                           endpoint=str(endpoint), rdzv_id=rdzv_id(run_dir),
                           node_rank=node_rank), *train_args(run_dir, overrides)]


def rdzv_id(run_dir: Path) -> str:
    """The same on every node that names the same run directory."""
    return f"shardwise-{run_dir.name}"


def render(command: list[str]) -> str:
    return shlex.join(command)
