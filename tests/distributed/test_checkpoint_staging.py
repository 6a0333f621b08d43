"""Async checkpoint staging: host buffers owned by the checkpointer, reused from save to save,
never aliasing live tensors, DTensors staged with CPU local shards (never through `from_local`,
which moves them back to the device), and the device peak of a save measured without disturbing
the step events' per-window peak."""

from __future__ import annotations

import pytest
import torch

from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.staging import HostStager
from shardwise.telemetry import memory
from tests.support.ranks import run_ranks
from tests.support.workers import stage_dtensors


def ptrs(staged: dict) -> dict[str, int]:
    return {k: v.untyped_storage().data_ptr() for k, v in staged.items() if isinstance(v, torch.Tensor)}


def live_state(step: int = 1) -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "m": torch.ones(5, dtype=torch.bfloat16),
            "step": step, "name": f"save-{step}", "nested": {"v": [torch.zeros(2), step]}}


def test_buffers_are_reused_across_saves():
    stager = HostStager()
    live = live_state(1)
    first = stager.stage(live)
    first_ptrs = ptrs(first) | {"v": first["nested"]["v"][0].data_ptr()}
    live["w"].mul_(2)
    live["step"], live["name"] = 2, "save-2"
    second = stager.stage(live)
    assert ptrs(second) | {"v": second["nested"]["v"][0].data_ptr()} == first_ptrs
    assert stager.builds == 1
    assert torch.equal(second["w"], torch.arange(12.0).reshape(3, 4) * 2)
    # non-tensor values are the ones of this save, not cached ones
    assert (second["step"], second["name"]) == (2, "save-2")
    assert stager.nbytes == 12 * 4 + 5 * 2 + 2 * 4


@pytest.mark.parametrize("change", ["new-key", "shape", "dtype"])
def test_a_changed_structure_rebuilds_the_buffers(change):
    stager = HostStager()
    live = live_state()
    stager.stage(live)
    if change == "new-key":  # e.g. the first optimizer step creating exp_avg
        live["exp_avg"] = torch.full((3, 4), 0.5)
    elif change == "shape":
        live["w"] = torch.ones(4, 4)
    else:
        live["m"] = torch.ones(5, dtype=torch.float32)
    staged = stager.stage(live)
    assert stager.builds == 2
    for key, value in live.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(staged[key], value) and staged[key].dtype == value.dtype
    assert stager.nbytes == sum(v.numel() * v.element_size() for v in live.values()
                                if isinstance(v, torch.Tensor)) + 2 * 4
    stager.stage(live)
    assert stager.builds == 2  # and stable again


def test_a_tensor_under_two_names_is_staged_once():
    """Tied embeddings: the model state dict names one parameter twice."""
    weight = torch.randn(8, 4)
    live = {"tok_emb.weight": weight, "lm_head.weight": weight, "other": torch.randn(8, 4)}
    stager = HostStager()
    staged = stager.stage(live)
    assert staged["tok_emb.weight"] is staged["lm_head.weight"]
    assert staged["other"] is not staged["tok_emb.weight"]
    assert stager.nbytes == 2 * 8 * 4 * 4
    assert torch.equal(staged["lm_head.weight"], weight)
    live["lm_head.weight"] = weight.clone()  # untied: its own buffer now
    assert stager.stage(live)["lm_head.weight"] is not staged["tok_emb.weight"]
    assert stager.builds == 2 and stager.nbytes == 3 * 8 * 4 * 4


def test_staged_values_are_a_snapshot_not_an_alias():
    """On a CPU run the 'copy to the CPU' must still be a copy: the next step overwrites the
    live tensors while the writer reads the staged ones."""
    live = live_state()
    staged = HostStager().stage(live)
    for key in ("w", "m"):
        assert staged[key].data_ptr() != live[key].data_ptr()
    live["w"].add_(100)
    live["nested"]["v"][0].add_(1)
    assert torch.equal(staged["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(staged["nested"]["v"][0], torch.zeros(2))
    assert staged["nested"]["v"][1] == 1 and isinstance(staged["nested"]["v"], list)


def test_pinning_follows_cuda(tmp_path):
    assert HostStager().pin is torch.cuda.is_available()
    assert Checkpointer(tmp_path, 0, False, device=torch.device("cpu")).stager.pin is False
    assert Checkpointer(tmp_path, 0, False, device=torch.device("cuda", 0)).stager.pin is True
    assert HostStager(pin=False).stage({"w": torch.ones(2)})["w"].is_pinned() is False


def test_dtensors_are_staged_with_cpu_locals_without_from_local(tmp_path):
    """World 2 on gloo; `DTensor.from_local` raises throughout staging and the async save."""
    reports = run_ranks(stage_dtensors, 2, str(tmp_path / "checkpoints"), timeout=120)
    for rank, report in enumerate(reports):
        assert report["types"] == ["DTensor", "DTensor"]
        assert report["local_devices"] == ["cpu", "cpu"]
        assert report["local_shapes"] == [(3, 3) if rank == 0 else (2, 3), (4,)]
        assert report["shapes"] == [(5, 3), (4,)]  # the global shapes
        assert report["same_spec"] and report["equal"] and not report["shares_memory"]
        assert report["step"] == 7
        assert report["unchanged_after_live_update"]
        assert report["reused"] and report["restaged_equal"] and report["builds"] == 1
        local_bytes = (9 if rank == 0 else 6) * 4 + 4 * 4
        assert report["host_staging_bytes"] == report["stager_nbytes"] == local_bytes
        assert report["device_peak_bytes"] is None  # CPU
        assert report["loaded_equal"]


class FakeCuda:
    """The allocator's peak counters, as `torch.cuda` exposes them, without a GPU."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def allocate(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.current))


def test_save_peak_does_not_disturb_the_window_peak(monkeypatch):
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    monkeypatch.setattr(memory, "_CARRIED", {})
    device = torch.device("cuda", 0)
    cuda.allocate(1000)  # a forward's activations ...
    cuda.allocate(-600)  # ... freed: the window's peak is 1000, 400 are held
    with memory.peak_during(device) as reading:
        cuda.allocate(300)  # staging temporaries
        cuda.allocate(-300)
    assert reading.bytes == 700
    cuda.allocate(100)
    assert memory.device_memory(device)["peak_mem_bytes"] == 1000  # as without the save
    cuda.allocate(50)
    assert memory.device_memory(device)["peak_mem_bytes"] == 550  # the next window: its own
    with memory.peak_during(torch.device("cpu")) as off_cuda:
        pass
    assert off_cuda.bytes is None
