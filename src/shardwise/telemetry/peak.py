"""Peak FLOP/s per device, the MFU denominator: a GPU datasheet table, a measured CPU probe, or the
`telemetry.peak_flops` override — and, beside it, a measured matmul probe.

GPU figures are NVIDIA's dense (no 2:4 sparsity) tensor-core peaks at boost clock — half the
"with sparsity" figure the datasheets print first. fp32 runs use the tf32 figure only when torch
lets matmuls use TF32 (`torch.get_float32_matmul_precision()` is not "highest"); otherwise the
plain fp32 (CUDA-core) figure. An unknown GPU gets no peak (and no MFU): a made-up denominator
would make MFU meaningless.

A CPU has no useful datasheet peak (it depends on vector width, clocks under load, the BLAS), so
the peak is *measured*: the best fp32 (or the run's bf16/fp16) matmul throughput over a few
seconds, with the thread count the run uses. It is an achievable peak, not a theoretical one, and
the manifest says so. It is cached as JSON in the shardwise cache, keyed by CPU model, threads,
torch version and dtype, so a machine pays for the probe once.

On a GPU, MFU keeps the datasheet denominator (comparable across runs and papers), and a short
probe of large square matmuls in the run's dtype (fp32 with or without TF32, as torch's matmul
precision says) is reported beside it as `peak_flops_probe`: what this GPU, at its clocks, power
cap and cuBLAS, actually reaches — a datasheet peak far above the probe means MFU can never get
near 1. Cached like the CPU probe, keyed by GPU name, torch version, dtype and TF32. On a CPU the
probe is the peak, so both fields are the same number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.utils.files import atomic_write_text

#: (regex on the upper-cased device name, table name, {precision: dense FLOP/s}); first match wins.
GPU_PEAKS: list[tuple[str, str, dict[str, float]]] = [
    # Blackwell (NVIDIA's Blackwell datasheet: half its "with sparsity" figures): the GB200's
    # B200 at 1,200 W, and the HGX / DGX B200 at 1,000 W ("B200" alone: the word boundary keeps
    # GB200 out)
    (r"\bGB200\b", "GB200", {"bf16": 2500e12, "fp16": 2500e12, "tf32": 1250e12, "fp32": 90e12}),
    (r"\bB200\b", "B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    (r"\bH200 NVL\b", "H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH200\b", "H200 SXM", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    (r"\bH100 NVL\b", "H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    (r"\bH100 PCIE\b", "H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    (r"\bH100\b", "H100 SXM", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    # A100 40 GB and 80 GB, SXM4 and PCIe: the same datasheet peaks
    (r"\bA100\b", "A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    (r"\bL40S\b", "L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    # "L4" alone: the word boundary keeps L40 / L40S out
    (r"\bL4\b", "L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
]

PROBE_SECONDS = 2.0  # default CPU probe length; $SHARDWISE_PEAK_PROBE_S overrides (tests: short)
PROBE_SIZES = (256, 512, 1024)  # square matmuls from L2-sized (768 KB fp32) to L3-sized
GPU_PROBE_SECONDS = 0.4  # default GPU probe length ($SHARDWISE_PEAK_PROBE_S too; 0: no probe)
GPU_PROBE_SIZES = (4096, 8192)  # large enough to fill an H100 (8192: 1.1 TFLOP, ~1 ms in bf16)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_warned: set[str] = set()


@dataclass(frozen=True)
class Peak:
    flops: float | None  # per device, FLOP/s; None: unknown (MFU is omitted)
    source: str  # "override" | "table" | "cpu-probe" | "unknown"
    detail: str  # human-readable: which entry, or how it was measured
    probe: float | None = None  # measured matmul FLOP/s beside it (None: not measured)
    probe_detail: str = ""

    def as_fields(self) -> dict[str, object]:
        return {"peak_flops": self.flops, "peak_flops_source": self.source,
                "peak_flops_detail": self.detail, "peak_flops_probe": self.probe,
                "peak_flops_probe_detail": self.probe_detail}


def gpu_matmul_precision(precision: str) -> str:
    """The table column a run's matmuls use: bf16/fp16 as asked; fp32 as tf32 when allowed."""
    if precision != "fp32":
        return precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def gpu_peak(device_name: str, precision: str) -> Peak:
    column = gpu_matmul_precision(precision)
    for pattern, name, peaks in GPU_PEAKS:
        if re.search(pattern, device_name.upper()):
            return Peak(peaks[column], "table",
                        f"{name} dense {column} datasheet peak (matched {device_name!r})")
    return Peak(None, "unknown", f"no table entry for {device_name!r}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_flops(dtype: torch.dtype = torch.float32, seconds: float = PROBE_SECONDS,
                         sizes: tuple[int, ...] = PROBE_SIZES) -> float:
    """Best matmul FLOP/s over short timed windows, on the current thread count.

    The best window, not the mean: interference (other processes, a frequency dip) only ever
    slows a window down, so the maximum is the closest estimate of what the hardware can do.
    """
    best = 0.0
    gen = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)  # warm up (and pick the kernel)
        flops = 2.0 * n ** 3
        reps = 1
        deadline = time.perf_counter() + seconds / len(sizes)
        while True:
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            dt = time.perf_counter() - t0
            best = max(best, flops * reps / dt)
            if time.perf_counter() >= deadline:
                break
            if dt < 0.01:  # windows of ~10 ms: long enough to time, short enough to pick the best
                reps *= 2
    return best


def measure_gpu_matmul_flops(dtype: torch.dtype, seconds: float = GPU_PROBE_SECONDS,
                             sizes: tuple[int, ...] = GPU_PROBE_SIZES,
                             device: torch.device | None = None) -> float:
    """Best matmul FLOP/s of a GPU over short windows, each timed by CUDA events around it (a host
    synchronisation per window: this runs once, before training). The best window, as on a CPU:
    throttling and interference only slow a window down."""
    best = 0.0
    gen = torch.Generator(device=device or "cuda").manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, device=device or "cuda", generator=gen).to(dtype)
        b = torch.randn(n, n, device=device or "cuda", generator=gen).to(dtype)
        out = torch.empty(n, n, dtype=dtype, device=a.device)
        torch.mm(a, b, out=out)  # warm up (and pick the kernel)
        reps = 1
        deadline = time.perf_counter() + seconds / len(sizes)
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
            best = max(best, 2.0 * n ** 3 * reps / (ms / 1e3))
            if time.perf_counter() >= deadline:
                break
            if ms < 10:  # windows of ~10 ms, as on the CPU
                reps *= 2
        del a, b, out
    torch.cuda.empty_cache()  # the probe's buffers are not the run's memory
    return best


def probe_seconds(default: float = PROBE_SECONDS) -> float:
    value = os.environ.get("SHARDWISE_PEAK_PROBE_S", "")
    try:
        return float(value) if value else default
    except ValueError:
        return default


def _cached(kind: str, key: dict[str, object], cache_dir: Path | None,
            measure: Callable[[], float], seconds: float) -> tuple[float, str]:
    """A probe's FLOP/s from the cache, or measured and cached; with where it came from. A cache
    that cannot be written only costs a probe per launch."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / "peak-flops" / f"{kind}-{digest}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key and float(cached["flops"]) > 0:
                return float(cached["flops"]), f"cached in {path}"
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged cache entry is measured again
    flops = measure()
    if path is not None:
        with contextlib.suppress(OSError):
            atomic_write_text(path, json.dumps({"key": key, "flops": flops, "seconds": seconds,
                                                "measured_at": time.time()}, indent=2))
    return flops, f"probed for {seconds:g} s"


def cpu_peak(precision: str, cache_dir: Path | None, seconds: float | None = None) -> Peak:
    """The cached CPU probe for this CPU model, thread count, torch version and dtype; measured
    (and cached) on a miss. It is the peak, and the probe beside it."""
    threads = torch.get_num_threads()
    key = {"cpu": cpu_model(), "threads": threads, "torch": torch.__version__,
           "dtype": precision}
    detail = (f"measured achievable {precision} matmul throughput of this CPU "
              f"({key['cpu']}, {threads} threads, torch {torch.__version__}), not a datasheet peak")
    seconds = probe_seconds() if seconds is None else seconds
    flops, origin = _cached("cpu", key, cache_dir,
                            lambda: measure_matmul_flops(_DTYPES[precision], seconds), seconds)
    return Peak(flops, "cpu-probe", f"{detail}; {origin}", flops, f"{detail}; {origin}")


def gpu_probe(device_name: str, precision: str, cache_dir: Path | None,
              measure: Callable[[torch.dtype, float], float],
              seconds: float | None = None) -> tuple[float | None, str]:
    """(FLOP/s, detail) of the matmul probe on this GPU in the run's precision, cached by GPU name,
    torch version, dtype and TF32; (None, why) when it is off or fails — a probe never stops a
    run."""
    column = gpu_matmul_precision(precision)
    seconds = probe_seconds(GPU_PROBE_SECONDS) if seconds is None else seconds
    if seconds <= 0:
        return None, "GPU matmul probe off ($SHARDWISE_PEAK_PROBE_S = 0)"
    key = {"gpu": device_name, "torch": torch.__version__, "dtype": precision,
           "tf32": column == "tf32"}
    detail = (f"measured best {column} matmul throughput of this GPU ({device_name}, torch "
              f"{torch.__version__}), beside the datasheet peak")
    try:
        flops, origin = _cached("gpu", key, cache_dir,
                                lambda: measure(_DTYPES[precision], seconds), seconds)
    except (RuntimeError, AssertionError) as err:  # out of memory, no usable CUDA
        return None, f"GPU matmul probe failed: {err}"
    return flops, f"{detail}; {origin}"


def resolve_peak(device: torch.device, precision: str, override: float,
                 cache_dir: Path | None, announce: bool = True,
                 measure_gpu: Callable[[torch.dtype, float], float] | None = None) -> Peak:
    """The peak for this device and precision: override > GPU table > CPU probe, with the probe
    beside it (a GPU is probed even when the table or the override gives the peak). For a GPU the
    table does not know, say once (when `announce`) how to get an MFU. `measure_gpu(dtype,
    seconds)` replaces the real GPU probe (tests)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        measure = measure_gpu or (lambda dtype, seconds: measure_gpu_matmul_flops(
            dtype, seconds, device=device))
        probe, probe_detail = gpu_probe(name, precision, cache_dir, measure)
        if override > 0:
            return Peak(float(override), "override", "telemetry.peak_flops", probe, probe_detail)
        peak = gpu_peak(name, precision)
        if peak.flops is None and announce and name not in _warned:
            _warned.add(name)
            print(f"note: no peak FLOP/s known for GPU {name!r}, so MFU/HFU are not reported. "
                  "Set telemetry.peak_flops to its dense peak for this precision (FLOP/s per "
                  "device, e.g. --set telemetry.peak_flops=989e12) to get them.", file=sys.stderr)
        return dataclasses.replace(peak, probe=probe, probe_detail=probe_detail)
    if override > 0:
        return Peak(float(override), "override", "telemetry.peak_flops")
    if device.type == "cpu":
        return cpu_peak(precision, cache_dir)
    return Peak(None, "unknown", f"no peak known for device type {device.type!r}")
