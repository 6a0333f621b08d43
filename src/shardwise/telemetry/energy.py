"""Energy a run's hardware used, read from the counters the hardware keeps — never estimated.

- GPU: NVML's `nvmlDeviceGetTotalEnergyConsumption` (millijoules since the driver loaded; Volta
  or newer), per rank for its own device, through `pynvml` (nvidia-ml-py) when it is installed,
  else libnvidia-ml through ctypes (the driver ships it).
- Host: RAPL, `/sys/class/powercap/intel-rapl:N/energy_uj` of every CPU package (and its DRAM
  zone where the host exposes one), microjoules that wrap at `max_energy_range_uj`. A package is
  shared by everything on the host, other processes included, so only the first local rank of
  each host reads it. The kernel lets only root read these files unless an administrator
  allows more (`chmod o+r`); the meter says so instead of guessing.
- Anything else: not measurable here, and the `energy` event says why.

The trainer's monitors take each rank's joules since the previous log step and gather them into
the step event (`energy_fields`).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
NVML_LIB = "libnvidia-ml.so.1"


@dataclass
class Counter:
    """A cumulative energy counter: `read()` -> joules since some origin (monotonic; wraps are
    unfolded by the caller through `wrap_j`)."""

    name: str
    read: Callable[[], float]
    wrap_j: float = 0.0  # the counter returns to 0 after this many joules (0: never)
    _last: float | None = None

    def start(self) -> None:
        self._last = self.read()

    def take(self) -> float:
        """Joules since the previous `take` (or `start`)."""
        now = self.read()
        last = now if self._last is None else self._last
        delta = now - last
        if delta < 0 and self.wrap_j > 0:  # the hardware counter wrapped around
            delta += self.wrap_j
        self._last = now
        return max(delta, 0.0)


@dataclass
class EnergyMeter:
    """This rank's counters: its GPU (device) and, on the first local rank, its host's packages."""

    device: list[Counter] = field(default_factory=list)
    host: list[Counter] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # why a part is not measured
    _t: float = 0.0

    @classmethod
    def for_rank(cls, device_type: str, device_index: int | None, local_rank: int,
                 powercap: Path = POWERCAP) -> EnergyMeter:
        meter = cls()
        if device_type == "cuda":
            counter, why = nvml_counter(device_index or 0)
            meter.device += [counter] if counter else []
            meter.notes += [why] if why else []
        if local_rank == 0:
            counters, why = rapl_counters(powercap)
            meter.host += counters
            meter.notes += [why] if why else []
        return meter

    @property
    def source(self) -> str:
        return "+".join(name for name, parts in (("nvml", self.device), ("rapl", self.host))
                        if parts)

    def start(self) -> None:
        for counter in (*self.device, *self.host):
            counter.start()
        self._t = time.perf_counter()

    def take(self) -> list[float]:
        """[device joules, host joules, seconds] since the last take; NaN where not measured."""
        now = time.perf_counter()
        out = [sum(c.take() for c in parts) if parts else math.nan
               for parts in (self.device, self.host)]
        out.append(now - self._t)
        self._t = now
        return out


def energy_fields(device_j: list[float], host_j: list[float], seconds: float) -> dict[str, Any]:
    """Step-event fields from every rank's [device, host] joules of one window (NaN where a rank
    measures nothing): `energy_j` (all measured, all ranks), `device_energy_j`, `host_energy_j`,
    `power_w` and `energy_source`. Nothing when no rank measured anything."""
    dev = [v for v in device_j if math.isfinite(v)]
    host = [v for v in host_j if math.isfinite(v)]
    if not dev and not host:
        return {}
    total = sum(dev) + sum(host)
    out: dict[str, Any] = {"energy_j": round(total, 4),
                           "energy_source": "+".join(n for n, v in (("nvml", dev), ("rapl", host))
                                                     if v)}
    if dev:
        out["device_energy_j"] = round(sum(dev), 4)
    if host:
        out["host_energy_j"] = round(sum(host), 4)
    if seconds > 0:
        out["power_w"] = round(total / seconds, 3)
    return out


# --- RAPL -------------------------------------------------------------------------------------

def rapl_counters(root: Path = POWERCAP) -> tuple[list[Counter], str]:
    """A counter per CPU package zone (and DRAM zone) that can be read, or a reason."""
    zones = sorted(root.glob("intel-rapl:*")) if root.is_dir() else []
    if not zones:
        return [], f"no RAPL counters on this host ({root}/intel-rapl:* does not exist)"
    counters, denied = [], []
    for zone in zones:
        name = _read_text(zone / "name") or zone.name
        depth = zone.name.count(":")
        if not (depth == 1 and name.startswith("package")) and name != "dram":
            continue  # psys contains the packages; core/uncore are inside them
        energy = zone / "energy_uj"
        try:
            int(energy.read_text())
        except PermissionError:
            denied.append(str(energy))
            continue
        except (OSError, ValueError):
            continue
        wrap = _read_text(zone / "max_energy_range_uj")
        counters.append(Counter(f"rapl:{zone.name}:{name}", _rapl_reader(energy),
                                wrap_j=int(wrap) / 1e6 if wrap and wrap.isdigit() else 0.0))
    if counters:
        return counters, ""
    if denied:
        return [], (f"RAPL counters exist but this user may not read them ({denied[0]}: the "
                    "kernel allows only root by default; an administrator can allow it with "
                    "chmod o+r)")
    return [], f"no readable CPU package zone under {root}"


def _rapl_reader(path: Path) -> Callable[[], float]:
    return lambda: int(path.read_text()) / 1e6


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


# --- NVML -------------------------------------------------------------------------------------

def nvml_counter(device_index: int) -> tuple[Counter | None, str]:
    """A counter of this rank's GPU, found by its UUID (CUDA's and NVML's device numbering
    differ under CUDA_VISIBLE_DEVICES), or a reason."""
    uuid = _cuda_uuid(device_index)
    for open_nvml in (_pynvml_reader, _ctypes_reader):
        try:
            read = open_nvml(uuid, device_index)
        except _NotSupported as err:
            return None, str(err)
        except Exception:  # this binding is missing or broken: try the next
            continue
        if read is not None:  # each binding has read the counter once: it works
            return Counter(f"nvml:{uuid or device_index}", read), ""
    return None, ("NVML is not available (neither pynvml nor libnvidia-ml could be loaded), "
                  "so GPU energy is not measured")


class _NotSupported(Exception):
    """The device has no energy counter (NVML_ERROR_NOT_SUPPORTED: older than Volta)."""


def _cuda_uuid(index: int) -> str | None:
    with contextlib.suppress(Exception):
        import torch

        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return None


def _pynvml_reader(uuid: str | None, index: int) -> Callable[[], float] | None:
    import pynvml

    pynvml.nvmlInit()
    handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid
              else pynvml.nvmlDeviceGetHandleByIndex(index))
    try:
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except pynvml.NVMLError_NotSupported:
        raise _NotSupported("this GPU has no energy counter (NVML: not supported; Volta or "
                            "newer has one)") from None
    return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0


_NVML_SUCCESS, _NVML_NOT_SUPPORTED = 0, 3


def _ctypes_reader(uuid: str | None, index: int) -> Callable[[], float] | None:
    lib = ctypes.CDLL(NVML_LIB)
    if lib.nvmlInit_v2() != _NVML_SUCCESS:
        return None
    handle = ctypes.c_void_p()
    status = (lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) if uuid
              else lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)))
    if status != _NVML_SUCCESS:
        return None
    value = ctypes.c_ulonglong()

    def read() -> float:
        code = lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(value))
        if code == _NVML_NOT_SUPPORTED:
            raise _NotSupported("this GPU has no energy counter (NVML: not supported; Volta or "
                                "newer has one)")
        if code != _NVML_SUCCESS:
            raise OSError(f"nvmlDeviceGetTotalEnergyConsumption failed with NVML status {code}")
        return value.value / 1000.0

    read()
    return read
