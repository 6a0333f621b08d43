"""Communication accounting: exact bytes against the analytic count, an independent count of the
same calls, and the per-rank trace."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardwise.telemetry.comm.tap import CommTap
from shardwise.telemetry.comm.totals import _union_length
from shardwise.telemetry.comm_theory import ring_fraction as wire_factor
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "step"]


@pytest.mark.timeout(150)
def test_ddp_world2_bytes_equal_the_analytic_count(small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 3},
                     parallel={"nproc": 2, "dp_replicate": 2, "dp_shard": 1})
    results = run_ranks(train, 2, spec, timeout=120)
    # unique parameters (the tied embedding / output weight once)
    params = results[0]["params"]
    unique = sum(v.numel() for k, v in params.items() if k != "output.weight") \
        if spec.model.fields.tie_embeddings else sum(v.numel() for v in params.values())
    for event in _steps(tmp_path / "run"):
        by_op = event["comm_by_op"]
        assert list(by_op) == ["all_reduce:dp_replicate"], by_op
        # DDP's one bucket of fp32 gradients + the global gradient norm's fp32 all-reduce (the
        # loss is all-reduced after the step, and only on log steps)
        assert by_op["all_reduce:dp_replicate"]["bytes"] == unique * 4 + 4
        assert by_op["all_reduce:dp_replicate"]["calls"] == 2
        # ring model: all-reduce sends 2(n-1)/n of the buffer, = 1 at n = 2
        assert event["comm_wire_bytes"] == unique * 4 + 4
        assert event["comm_bytes_per_rank"] == [unique * 4 + 4] * 2
        # each replica reads half the global batch in its own step time
        for rank in range(2):
            assert event["samples_per_s_per_rank"][rank] == pytest.approx(
                spec.batch.global_batch / 2 / event["step_time_s_per_rank"][rank], rel=1e-3)
        assert event["comm_ratio_to_min"] == pytest.approx((unique * 4 + 4) / (unique * 4))


class _DispatchCount(torch.utils._python_dispatch.TorchDispatchMode):
    """An independent count: every c10d op that reaches the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::") and "barrier" not in name:
            op = name.split("::")[1].strip("_")
            flat = [t for t in _flatten(args[:2]) if isinstance(t, torch.Tensor)]
            key = {"allreduce": "all_reduce", "allgather_base": "all_gather",
                   "allgather_into_tensor_coalesced": "all_gather",
                   "reduce_scatter_base": "reduce_scatter"}.get(op, op)
            self.bytes[key] = self.bytes.get(key, 0) + sum(t.numel() * t.element_size()
                                                           for t in flat)
        return func(*args, **(kwargs or {}))


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, list | tuple):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _fsdp_counts(store: Any) -> dict[str, Any]:
    """One FSDP2 forward/backward of a small MLP, counted by the tap and by the dispatcher."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        tap = CommTap({mesh.get_group().group_name: "dp_shard"}).install()
        counter = _DispatchCount()
        try:
            tap.begin_step(1)
            with counter:
                model(torch.randn(4, 16)).sum().backward()
            step = tap.end_step()
            # a collective from another thread (as the background checkpoint writer issues):
            # counted apart, never in the training step
            tap.begin_step(2)
            worker = threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)))
            worker.start()
            worker.join()
            other = tap.end_step()
        finally:
            tap.uninstall()
        return {"tap": {k.split(":")[0]: v.bytes for k, v in step.by_op.items()},
                "dispatch": counter.bytes, "inflight": step.inflight_s,
                "background": {k.split(":")[0]: v.bytes for k, v in tap.background.items()},
                "other_step_bytes": other.bytes}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tap_matches_an_independent_dispatcher_count_for_fsdp():
    for result in run_ranks(_fsdp_counts, 2, timeout=100):
        tap, dispatch = result["tap"], result["dispatch"]
        params = (16 * 32 + 32 + 32 * 8 + 8) * 4
        # every parameter gathered for forward and again for backward (resharded after forward)
        assert tap["all_gather"] == 2 * params, (tap, dispatch)
        assert tap["reduce_scatter"] == params  # full gradient input, once
        # the dispatcher sees the same calls with both buffers (all-gather: output + input
        # shard; reduce-scatter: output shard + input) -> bytes = tap bytes * (1 + 1/n)
        assert dispatch["all_gather"] == 2 * params * 1.5, (tap, dispatch)
        assert dispatch["reduce_scatter"] == params * 1.5, (tap, dispatch)
        assert result["inflight"] > 0
        assert result["background"] == {"all_reduce": 16} and result["other_step_bytes"] == 0


def test_wire_factors_and_union():
    assert wire_factor("all_reduce", 4) == 1.5
    assert wire_factor("all_gather", 4) == 0.75
    assert wire_factor("recv", 2) == 0.0
    assert _union_length([[0, 2], [1, 3], [5, 6]], now=10) == pytest.approx(4)
    assert _union_length([[0, float("inf")]], now=2.5) == pytest.approx(2.5)


@pytest.mark.timeout(150)
def test_trace_has_phases_and_collectives_per_rank(small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 4},
                     parallel={"nproc": 2, "dp_shard": 2},
                     telemetry={"trace_from": 2, "trace_steps": 2})
    run_ranks(train, 2, spec, timeout=120)
    for rank in range(2):
        trace = json.loads((tmp_path / "run" / "trace" / f"rank-{rank}.json").read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["name"] for e in spans}
        assert {"data", "forward", "backward", "optimizer", "step 2", "step 3"} <= names
        assert any(n.startswith("all_gather [dp_shard]") for n in names)
        assert any(n.startswith("reduce_scatter [dp_shard]") for n in names)
        assert {e["args"].get("step") for e in spans if "step" in e.get("args", {})} == {2, 3}
        assert all(e["dur"] >= 0 and e["pid"] == rank for e in spans)
