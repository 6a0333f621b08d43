"""Energy is read from hardware counters or not at all: RAPL files (a fake powercap tree with a
wrap-around), NVML (a stand-in pynvml module), and the reasons given when neither can be read."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest

from shardwise.telemetry.energy import EnergyMeter, energy_fields, nvml_counter, rapl_counters


def _zone(root: Path, name: str, label: str, energy_uj: int, wrap_uj: int = 2**32) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{wrap_uj}\n")
    return zone


def test_rapl_packages_and_dram_are_read_psys_and_subzones_are_not(tmp_path):
    pkg = _zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000, wrap_uj=5_000_000)
    _zone(tmp_path, "intel-rapl:0:0", "core", 7)  # inside the package: would count twice
    dram = _zone(tmp_path, "intel-rapl:0:1", "dram", 500_000)
    _zone(tmp_path, "intel-rapl:1", "psys", 9)  # the platform: contains the packages
    meter = EnergyMeter.for_rank("cpu", None, local_rank=0, powercap=tmp_path)
    assert meter.source == "rapl" and [c.name for c in meter.host] == [
        "rapl:intel-rapl:0:package-0", "rapl:intel-rapl:0:1:dram"]
    meter.start()
    (pkg / "energy_uj").write_text("4_500_000".replace("_", ""))
    (dram / "energy_uj").write_text("750000")
    device, host, seconds = meter.take()
    assert math.isnan(device) and host == pytest.approx(3.5 + 0.25) and seconds > 0
    (pkg / "energy_uj").write_text("500000")  # wrapped at 5 J: 0.5 J past the wrap
    assert meter.take()[1] == pytest.approx(5.0 - 4.5 + 0.5)


def test_only_the_first_local_rank_reads_the_host(tmp_path):
    _zone(tmp_path, "intel-rapl:0", "package-0", 1)
    assert EnergyMeter.for_rank("cpu", None, local_rank=1, powercap=tmp_path).source == ""


def test_unreadable_or_absent_rapl_says_why(tmp_path, monkeypatch):
    counters, why = rapl_counters(tmp_path / "none")
    assert counters == [] and "no RAPL counters on this host" in why
    _zone(tmp_path, "intel-rapl:0", "package-0", 1)
    real = Path.read_text

    def denied(self: Path, *args, **kwargs):  # what a non-root user meets (root reads anything)
        if self.name == "energy_uj":
            raise PermissionError(13, "Permission denied")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    meter = EnergyMeter.for_rank("cpu", None, local_rank=0, powercap=tmp_path)
    assert meter.source == "" and "may not read them" in meter.notes[0]
    assert "chmod o+r" in meter.notes[0]


def _fake_pynvml(joules: list[float], supported: bool = True) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # pynvml's own name
        pass

    def energy(handle):
        if not supported:
            raise NVMLError_NotSupported()
        return int(joules[0] * 1000)  # millijoules

    nvml.NVMLError_NotSupported = NVMLError_NotSupported
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nvml.nvmlDeviceGetHandleByUUID = lambda u: ("handle", u)
    nvml.nvmlDeviceGetTotalEnergyConsumption = energy
    return nvml


def test_nvml_reads_the_device_counter(monkeypatch):
    joules = [1000.0]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(joules))
    counter, why = nvml_counter(0)
    assert counter is not None and why == ""
    counter.start()
    joules[0] = 1234.5
    assert counter.take() == pytest.approx(234.5)


def test_a_gpu_without_an_energy_counter_is_not_measured(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([0.0], supported=False))
    counter, why = nvml_counter(0)
    assert counter is None and "no energy counter" in why


def test_without_nvml_a_gpu_rank_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    monkeypatch.setattr("shardwise.telemetry.energy.NVML_LIB", "libnot-there.so.0")
    counter, why = nvml_counter(0)
    assert counter is None and "NVML is not available" in why


def test_fields_sum_the_ranks_that_measure():
    nan = math.nan
    assert energy_fields([nan, nan], [nan, nan], 1.0) == {}
    out = energy_fields([100.0, 120.0], [30.0, nan], 2.0)
    assert out == {"energy_j": 250.0, "energy_source": "nvml+rapl", "device_energy_j": 220.0,
                   "host_energy_j": 30.0, "power_w": 125.0}
