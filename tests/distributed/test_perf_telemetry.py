"""Memory and pipeline-bubble measurements: activation bytes against a hand count, the bubble
theory, and the step/memory event fields of a 2-rank pipeline run."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.telemetry.bubble import theoretical_bubble
from shardwise.telemetry.memory import ActivationSampler, current_rss_bytes, device_memory
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train


def test_activation_sampler_counts_saved_storages_once_and_no_weights():
    """x -> Linear -> ReLU -> Linear -> sum: backward keeps x (first Linear's weight gradient) and
    the ReLU output (its own mask and the second Linear's input: one storage, counted once). The
    weights autograd also keeps are parameters, not activations."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 8, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ActivationSampler()
    sampler.arm([model], [opt])
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)  # no gradients: the window stays closed
    model(x).sum().backward()
    opt.step()
    assert sampler.peak_bytes == (4 * 16 + 4 * 32) * 4
    sampler.disarm()
    gc.collect()
    assert sampler._live_bytes == 0  # everything saved was released by backward
    model(x).sum().backward()  # disarmed: nothing more is counted
    assert sampler.peak_bytes == (4 * 16 + 4 * 32) * 4 and sampler._live_bytes == 0


def test_a_step_that_raises_does_not_leave_hooks_behind():
    """A failure between forward and optimizer step leaves the sampling window open; the next
    sampler to open closes it, so the stale hooks count nothing more."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stale = ActivationSampler()
    stale.arm([model], [opt])
    x = torch.randn(4, 16)
    kept = model(x)  # the window opens; "the step raises" before backward and the optimizer
    fresh = ActivationSampler()
    fresh.arm([model], [opt])
    before = stale._peak
    model(x).sum().backward()
    opt.step()
    assert stale._peak == before  # no longer counting
    assert fresh.peak_bytes == (4 * 16 + 4 * 32) * 4
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None:  # private; where it exists, check that no hooks are left pushed
        assert top(False) is None
    del kept


def test_device_memory_on_cpu():
    mem = device_memory(torch.device("cpu"))
    assert mem["peak_mem_bytes"] >= mem["rss_bytes"] > 0
    assert current_rss_bytes() > 0


@pytest.mark.parametrize(("schedule", "pp", "m", "v", "want"), [
    ("gpipe", 2, 4, 1, 1 / 5), ("1f1b", 4, 8, 1, 3 / 11), ("interleaved-1f1b", 2, 4, 2, 1 / 9),
    ("zero-bubble", 2, 4, 2, 0.0), ("1f1b", 1, 4, 1, 0.0),
])
def test_theoretical_bubble(schedule, pp, m, v, want):
    assert theoretical_bubble(schedule, pp, m, v) == pytest.approx(want)


def test_pipeline_run_reports_bubble_memory_and_mfu(small_corpus, tmp_path, monkeypatch):
    """pp=2 GPipe with 4 micro-batches at world 2: each step event has a measured bubble per rank
    (at least the theory's 1/5 on this CPU) and per-rank memory; one memory event per run."""
    monkeypatch.setenv("SHARDWISE_PEAK_PROBE_S", "0.3")
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 3},
                     parallel={"nproc": 2, "pp": 2, "dp_shard": 1, "pp_schedule": "gpipe"},
                     model={"tie_embeddings": False},
                     batch={"global_batch": 8, "micro_batch": 2})
    run_ranks(train, 2, spec)
    events = [json.loads(line)
              for line in (Path(spec.run.dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == 3
    for e in steps:
        assert e["bubble_fraction_theory"] == pytest.approx(1 / 5)
        assert e["comm_by_op"]["send:pp"]["bytes"] > 0, e["comm_by_op"]  # stage-to-stage traffic
        assert len(e["bubble_fraction_per_rank"]) == 2
        assert all(0 < f < 1 for f in e["bubble_fraction_per_rank"]), e
        assert e["bubble_fraction"] == pytest.approx(sum(e["bubble_fraction_per_rank"]) / 2)
        assert all(b > 0 and i >= 0 for b, i in zip(e["stage_busy_s_per_rank"],
                                                    e["stage_idle_s_per_rank"], strict=True))
        assert len(e["peak_mem_bytes_per_rank"]) == 2
        assert e["peak_mem_bytes"] == max(e["peak_mem_bytes_per_rank"]) > 0
        assert 0 < e["mfu"] == e["hfu"] <= 1
    memory = [e for e in events if e["kind"] == "memory"]
    assert len(memory) == 1
    m = memory[0]
    for key in ("param_bytes_per_rank", "grad_bytes_per_rank", "optimizer_bytes_per_rank",
                "activation_bytes_per_rank"):
        assert len(m[key]) == 2 and all(v > 0 for v in m[key]), key
