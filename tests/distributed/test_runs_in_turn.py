"""Runs one after another in one process (`shardwise verify`'s layouts of one world size, a
notebook) each live on their own mesh. torch caches DTensor sharding results keyed by mesh
*value*, so without `parallel.distributed.forget_meshes` a later run's cached ops returned
tensors on the earlier run's mesh, whose process groups were destroyed (CI: "Could not resolve
the process group registered under the name 22" in a later world-4 ZeRO-1 + ep2 run)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from shardwise.parallel.distributed import init_distributed, shutdown
from shardwise.parallel.tensor_parallel import _local
from shardwise.spec.layout import ParallelSection
from tests.support.ranks import run_ranks


def _one_run(store: Any, i: int) -> dict[str, Any]:
    """Start a run, do the ops a training step does on its mesh, and say whose mesh came back."""
    ctx = init_distributed(ParallelSection(dp_shard=2, zero=2), store=dist.PrefixStore(f"run{i}", store))
    mesh = ctx.mesh["dp_shard"]
    w = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(torch.ones(2), mesh, [Replicate()]))
    outs = [w.detach() * 2, (w + 1).sum(), b.to(torch.float64)]
    local = _local(b, partial=True)
    local.sum().backward()
    seen = {"ops": [o.device_mesh is mesh for o in outs], "grad": b.grad.device_mesh is mesh,
            "sum": outs[1].full_tensor().item()}
    # the group the ops' mesh names resolves in this run and reduces over both ranks
    t = torch.ones(1)
    dist.all_reduce(t, group=outs[0].device_mesh.get_group())
    seen["reduced"] = t.item()
    shutdown(clean=True)
    return seen


def _runs(store: Any) -> list[dict[str, Any]]:
    return [_one_run(store, i) for i in range(3)]


def test_each_run_in_a_process_gets_its_own_mesh_back():
    for rank_runs in run_ranks(_runs, 2):
        for seen in rank_runs:
            assert seen == {"ops": [True, True, True], "grad": True, "sum": 36.0, "reduced": 2.0}
