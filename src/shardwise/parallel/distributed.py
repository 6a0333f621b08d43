"""Process-group start-up and the DistContext that carries topology through a run.

There is no global topology: the context is built once per process and passed down explicitly.
A world of one process started by `shardwise train` runs with no process group at all, so the
single-process reference is plain PyTorch. Two world-1 cases do get a real group of one: a process
started by torchrun (every collective then goes through the chosen backend, so a one-GPU NCCL run
exercises the same code paths as a multi-GPU one), and a layout that asks for FSDP on one rank
(`zero = 2/3`, which needs a mesh).
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.compat import clear_dtensor_caches
from shardwise.parallel.devices import (
    check_local_workers,
    pick_device,
    resolve_backend,
    resolve_device_type,
)
from shardwise.parallel.dims import MESH_AXES, ParallelDims
from shardwise.resilience.attempt import count_start, launch_attempt
from shardwise.spec.layout import ParallelSection


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
    # With cp > 1, gradients are reduced over the cp ranks too (each holds part of every
    # sequence): dp_replicate x dp_shard x cp flattened (DDP), and the FSDP mesh, dp_shard x cp
    # flattened (with dp_replicate in front for HSDP). None when cp = 1.
    dp_cp_mesh: DeviceMesh | None = None
    fsdp_cp_mesh: DeviceMesh | None = None
    # The launcher's store, without the per-attempt prefix: keys set in it outlive a restart of
    # the workers (None for one process without a group, or a group this code did not create).
    store: dist.Store | None = None

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

    @property
    def leads_replica(self) -> bool:
        """One rank per data-parallel replica: coordinate 0 of the pp, cp and tp axes (its peers
        on those axes read the same samples)."""
        if self.mesh is None:
            return True
        coordinate = dict(zip(MESH_AXES, self.mesh.get_coordinate() or [], strict=True))
        return all(coordinate[axis] == 0 for axis in ("pp", "cp", "tp"))

    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    def grad_group(self) -> dist.ProcessGroup | None:
        """The ranks whose gradients DDP sums: the data-parallel ranks, and the cp ranks."""
        return self.dp_cp_mesh.get_group() if self.dp_cp_mesh is not None else self.dp_group()

    @property
    def cp_rank(self) -> int:
        return self.mesh["cp"].get_local_rank() if self.mesh is not None else 0


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


def set_cpu_threads(local_world_size: int) -> int:
    """cores / local workers (>= 1): oversubscribed workers run 2-8x slower on CPU."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


#: cuBLAS needs this before its first handle is created to pick deterministic GEMM workspaces
CUBLAS_DETERMINISTIC = ":4096:8"


def launcher_store(timeout_s: float) -> dist.Store:
    """The store the launcher named (MASTER_ADDR/PORT, or the elastic agent's own): rank 0
    hosts it unless the agent does."""
    rank, _, world, _ = env_world()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=(rank == 0 and not agent_store),
                         timeout=timedelta(seconds=timeout_s))


def all_ranks_here(world: int) -> bool:
    """Whether every rank of the group runs on this machine: a world of one, or a launcher that
    says so (LOCAL_WORLD_SIZE, which torchrun and the local launch set, equal to the world). A
    launcher that does not set it may have ranks elsewhere: no guess is made."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return world == 1 or (local is not None and int(local) == world)


#: the environment that picks the interface gloo's and NCCL's sockets listen on
SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str | None:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS and the BSDs)."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


#: what bind_to_loopback replaced, put back by `shutdown` (None: the variable was not set)
_REPLACED_IFNAMES: dict[str, str | None] = {}


def bind_to_loopback() -> None:
    """Make this process's gloo groups (and NCCL's bootstrap) listen on the loopback interface.

    For a group whose ranks all run on this machine: by default gloo listens on the address this
    host's name resolves to and NCCL on its first non-loopback interface, which other machines
    can reach. Set before any group is made (each new group reads it) and kept until `shutdown`;
    a choice of interface in the environment is overridden meanwhile, since no peer of this
    group is elsewhere."""
    name = loopback_interface()
    if name is None:
        return
    for variable in SOCKET_IFNAME_ENV:
        _REPLACED_IFNAMES.setdefault(variable, os.environ.get(variable))
        os.environ[variable] = name


def restore_socket_interfaces() -> None:
    """Put back what `bind_to_loopback` replaced (a process that trains in-process, like a
    notebook calling shardwise.train, keeps its own choice for whatever it runs next)."""
    for variable, value in _REPLACED_IFNAMES.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    _REPLACED_IFNAMES.clear()


def init_distributed(section: ParallelSection, store: dist.Store | None = None, *,
                     deterministic: bool = False) -> DistContext:
    """Join the process group named by the environment (or `store`) and build the mesh.

    `deterministic` (run.determinism strict/invariant) sets what cuBLAS reads when CUDA first
    initialises, so it must be decided here, before this process touches its GPU.
    Each elastic restart attempt uses its own store prefix: reusing keys of a dead attempt made
    gloo's `connectFullMesh` hang or fail after a restart.
    """
    rank, local_rank, world, local_world = env_world()
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    device_type = resolve_device_type(section)
    check_local_workers(local_world, device_type)
    set_cpu_threads(local_world)
    device = pick_device(device_type, local_rank)
    dims = ParallelDims.from_spec(section, world)
    launched = under_launcher() or store is not None
    if world == 1 and not launched and dims.zero < 2 and not dist.is_initialized():
        return DistContext(rank, local_rank, 1, 1, device, dims, None)
    backend = resolve_backend(section, device_type)
    timeout = timedelta(seconds=section.timeout_s)
    base_store = None
    if not dist.is_initialized():
        if store is None and world == 1 and not under_launcher():
            store = dist.HashStore()  # FSDP on one rank, in this process: a group of one
        elif store is None:
            store = launcher_store(section.timeout_s)
            count_start(store, rank)  # the attempt all nodes agree on (resilience.attempt)
        attempt = launch_attempt()
        base_store = store
        if all_ranks_here(world):
            bind_to_loopback()
        store = dist.PrefixStore(f"/shardwise/attempt_{attempt}", store)
        kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        forget_meshes()  # a group of an earlier run in this process (verify's layouts in turn)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout, **kwargs)
    mesh, dp_mesh = build_mesh(dims, device.type)
    dp_cp_mesh, fsdp_cp_mesh = build_cp_meshes(mesh, dims) if dims.cp > 1 else (None, None)
    return DistContext(rank, local_rank, world, local_world, device, dims, mesh, dp_mesh,
                       dp_cp_mesh, fsdp_cp_mesh, base_store)


def build_mesh(dims: ParallelDims, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
    """One mesh with every axis (size-1 axes included), and its flattened data-parallel view.

    The flattened view is returned rather than sliced from the root later: torch deprecates
    slicing flattened dims from the root mesh.
    """
    shape = dims.mesh_shape
    mesh = init_device_mesh(device_type, tuple(shape[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")


def build_cp_meshes(mesh: DeviceMesh, dims: ParallelDims) -> tuple[DeviceMesh, DeviceMesh]:
    """(dp_replicate x dp_shard x cp flattened, the FSDP mesh) for cp > 1, as torchtitan lays
    them out: FSDP shards over dp_shard x cp flattened ("dp_shard_cp"); HSDP replicates that
    across dp_replicate. The HSDP view slices a flattened dim from the root, which torch 2.13
    warns will be deprecated (and still does; no other public way builds it on 2.11)."""
    dp_cp = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if dims.dp_replicate == 1:
        return dp_cp, shard_cp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return dp_cp, mesh["dp_replicate", "dp_shard_cp"]


def shutdown(clean: bool = False) -> None:
    """Leave the process group. After a clean finish, first wait for every rank: a rank that
    closes its connections while a peer still reads the last broadcast made gloo abort the peer
    ("terminate called without an active exception") in about one run in ten."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
    forget_meshes()
    restore_socket_interfaces()


def forget_meshes() -> None:
    """Forget every mesh torch cached for a process group that is gone (see
    `compat.clear_dtensor_caches`): a later run in this process (`verify`'s layouts in turn, a
    notebook) would otherwise get parameters back on the earlier run's mesh ("Could not resolve
    the process group registered under the name 22"), or silently on a same-named group."""
    clear_dtensor_caches()
