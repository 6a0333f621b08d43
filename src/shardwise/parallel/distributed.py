"""Process-group start-up and the DistContext that carries topology through a run.

There is no global topology: the context is built once per process and passed down explicitly.
A world of one process runs with no process group at all, so the single-process reference is plain
PyTorch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.parallel.dims import MESH_AXES, ParallelDims
from shardwise.spec.runspec import ParallelSection


@dataclass
class DistContext:
    """Where this process sits: rank, world, device, the parallel degrees and the named mesh."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None  # None when world_size == 1
    dp_mesh: DeviceMesh | None = None  # dp_replicate x dp_shard flattened: ranks with different data

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def dp_rank(self) -> int:
        """Index of this rank among the data-parallel ranks (which data it reads)."""
        return self.dp_mesh.get_local_rank() if self.dp_mesh is not None else 0

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None


def env_world() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun-style environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, local_rank, world, local_world


def under_launcher() -> bool:
    """True when started by torchrun / the elastic agent (the env names our rank)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def pick_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_cpu_threads(local_world_size: int) -> int:
    """cores / local workers (>= 1): oversubscribed workers run 2-8x slower on CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def init_distributed(section: ParallelSection, store: dist.Store | None = None) -> DistContext:
    """Join the process group named by the environment (or `store`) and build the mesh.

    Each elastic restart attempt uses its own store prefix: reusing keys of a dead attempt made
    gloo's `connectFullMesh` hang or fail after a restart.
    """
    rank, local_rank, world, local_world = env_world()
    set_cpu_threads(local_world)
    device = pick_device(local_rank)
    dims = ParallelDims.from_spec(section, world)
    if world == 1:
        return DistContext(rank, local_rank, 1, 1, device, dims, None)
    backend = section.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=section.timeout_s)
    if not dist.is_initialized():
        if store is None:
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                is_master=(rank == 0 and not agent_store), timeout=timeout,
            )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"/shardwise/attempt_{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
    mesh, dp_mesh = build_mesh(dims, device.type)
    return DistContext(rank, local_rank, world, local_world, device, dims, mesh, dp_mesh)


def build_mesh(dims: ParallelDims, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """One mesh with every axis (size-1 axes included), and its flattened data-parallel view.

    The flattened view is returned rather than sliced from the root later: torch deprecates
    slicing flattened dims from the root mesh.
    """
    shape = dims.mesh_shape
    mesh = init_device_mesh(device_type, tuple(shape[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")


def shutdown(clean: bool = False) -> None:
    """Leave the process group. After a clean finish, first wait for every rank: a rank that
    closes its connections while a peer still reads the last broadcast made gloo abort the peer
    ("terminate called without an active exception") in about one run in ten."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
