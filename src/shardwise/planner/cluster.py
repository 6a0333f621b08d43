"""Cluster presets, and resolving `--cluster NAME|FILE` to a ClusterSpec.

Every figure below says where it comes from. Datasheet "GB" of HBM are taken as what the driver
reports as the device's total (nvidia-smi), in GiB; peaks are NVIDIA's dense tensor-core figures
(half the "with sparsity" number the datasheets print first) and agree with
`shardwise.telemetry.peak.GPU_PEAKS` (a test checks it). Link bandwidths are per direction: NVIDIA
quotes NVLink as the bidirectional total per GPU (H100/H200: 18 links x 50 GB/s = 900 GB/s, so
450 GB/s each way; A100: 12 x 50 = 600 GB/s, 300 each way); a 400 Gb/s NIC moves 50 GB/s each way.
Latencies per ring step are NCCL's own tuning model for the ring/Simple protocol
(`src/graph/tuning.cc`, `hwLat`: NVLink 3.4 µs, network 9.6 µs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from shardwise.errors import SpecError
from shardwise.spec.cluster import (
    ClusterSection,
    ClusterSpec,
    DeviceSection,
    LinkSection,
    PeakSection,
    load_cluster,
)
from shardwise.spec.toml import suggest as _suggest
from shardwise.utils.files import cache_root

NCCL_NVLINK_LAT_US = 3.4  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]
NCCL_NET_LAT_US = 9.6  # NCCL tuning.cc hwLat[NET][Ring][Simple]

# H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet, SXM column): bf16/fp16 989.4 dense TFLOP/s,
# tf32 494.7, fp32 66.9; 80 GB HBM3, which nvidia-smi reports as 81,559 MiB = 79.6 GiB.
_H100_PEAK = PeakSection(fp32=66.9, bf16=989.4, fp16=989.4, tf32=494.7)
# H100 SXM5 (datasheet, SXM column): HBM3 3.35 TB/s, max TDP 700 W; 132 SMs (the H100 whitepaper's
# SXM5 configuration). Idle board power 80 W: measured on an H200 SXM at idle (80.3 W,
# api.serialalice.pt GPU energy benchmark, 2026), taken for the H100 too (same board power class);
# set [device] idle_power_w for your own.
_H100_DEVICE = DeviceSection(generation="hopper", memory_bandwidth_gbs=3350.0, sms=132,
                             power_w=700.0, idle_power_w=80.0)
# NVLink 4: 900 GB/s bidirectional per GPU (datasheet) -> 450 GB/s per direction.
_NVLINK4 = LinkSection(bandwidth_gbs=450.0, latency_us=NCCL_NVLINK_LAT_US)
# ConnectX-7 NDR InfiniBand, 400 Gb/s per port -> 50 GB/s per direction (DGX H100 user guide:
# 8 single-port NICs for the compute fabric, one per GPU).
_NDR400 = LinkSection(bandwidth_gbs=50.0, latency_us=NCCL_NET_LAT_US)


def dgx_h100() -> ClusterSpec:
    """8 x H100 SXM5 80 GB per node, NVLink 4 / NVSwitch, 8 x 400 Gb/s InfiniBand (DGX H100)."""
    return ClusterSpec(
        ClusterSection(nodes=1, devices_per_node=8, device_memory_gib=79.6, nics_per_node=8,
                       name="dgx-h100"),
        _H100_PEAK, _NVLINK4, _NDR400, _H100_DEVICE)


def h200_nvl8() -> ClusterSpec:
    """8 x H200 SXM 141 GB per node (HGX H200 8-GPU): the H100's compute and NVLink 4 with more
    HBM3e. NVIDIA H200 datasheet (SXM): bf16 989 dense TFLOP/s, 141 GB (nvidia-smi: 143,771 MiB =
    140.4 GiB), HBM3e 4.8 TB/s, max TDP 700 W; networking as the DGX H100 (8 x 400 Gb/s)."""
    return ClusterSpec(
        ClusterSection(nodes=1, devices_per_node=8, device_memory_gib=140.4, nics_per_node=8,
                       name="h200-nvl8"),
        _H100_PEAK, _NVLINK4, _NDR400,
        DeviceSection(generation="hopper", memory_bandwidth_gbs=4800.0, sms=132, power_w=700.0,
                      idle_power_w=80.0))


def dgx_b200() -> ClusterSpec:
    """8 x B200 per node (DGX / HGX B200). NVIDIA's Blackwell datasheet, HGX B200 column (1,000
    W): bf16/fp16 2,250 dense TFLOP/s (4.5 PFLOP/s with sparsity), tf32 1,100, fp32 80; HBM3e 8
    TB/s; 180 GB, which nvidia-smi reports as 179 GiB (Vultr's HGX B200 hardware overview, 2026);
    148 SMs; NVLink 5: 1.8 TB/s bidirectional per GPU, 900 GB/s each way; 8 x 400 Gb/s
    ConnectX-7 for the compute fabric (DGX B200 user guide), as the DGX H100. Idle power: the
    H200's 80 W is not this board's; not known here (0: set [device] idle_power_w). No published
    Blackwell bf16 training run is in the reference set: the kernel model runs it at Hopper's
    fitted efficiencies (`chip.EFFICIENCIES_OF`) and its band says so."""
    return ClusterSpec(
        ClusterSection(nodes=1, devices_per_node=8, device_memory_gib=179.0, nics_per_node=8,
                       name="dgx-b200"),
        PeakSection(fp32=80.0, bf16=2250.0, fp16=2250.0, tf32=1100.0),
        LinkSection(bandwidth_gbs=900.0, latency_us=NCCL_NVLINK_LAT_US),
        _NDR400,
        DeviceSection(generation="blackwell", memory_bandwidth_gbs=8000.0, sms=148,
                      power_w=1000.0))


def a100_80g() -> ClusterSpec:
    """8 x A100 SXM4 80 GB per node (DGX A100): NVIDIA A100 datasheet: bf16/fp16 312 dense
    TFLOP/s, tf32 156, fp32 19.5; 80 GB HBM2e (nvidia-smi: 81,920 MiB = 80.0 GiB); NVLink 3 600
    GB/s bidirectional (300 per direction); 8 x 200 Gb/s HDR InfiniBand (DGX A100 user guide) =
    25 GB/s per direction each; HBM2e 2,039 GB/s, max TDP 400 W (datasheet, 80 GB SXM); 108 SMs
    (the A100 whitepaper). Idle power is not known here (0: the energy estimate counts busy time
    only; set [device] idle_power_w)."""
    return ClusterSpec(
        ClusterSection(nodes=1, devices_per_node=8, device_memory_gib=80.0, nics_per_node=8,
                       name="a100-80g"),
        PeakSection(fp32=19.5, bf16=312.0, fp16=312.0, tf32=156.0),
        LinkSection(bandwidth_gbs=300.0, latency_us=NCCL_NVLINK_LAT_US),
        LinkSection(bandwidth_gbs=25.0, latency_us=NCCL_NET_LAT_US),
        DeviceSection(generation="ampere", memory_bandwidth_gbs=2039.0, sms=108, power_w=400.0))


CPU_DEVICES = 2  # shardwise's default on a machine without a GPU: 2 local worker processes
GLOO_STEP_US = 450.0  # gloo over loopback, per ring step (TORCH_ON_CPU.md: 4 KB all-reduce 0.9 ms)
GLOO_LOOPBACK_GBS = 0.32  # effective (4 MB all-reduce in 14 ms at world 2)
CPU_DEFAULT_GFLOPS = 100.0  # when no probe is cached (this project's 2-core machine: 106 per worker)


def cpu_local(workers: int = CPU_DEVICES) -> ClusterSpec:
    """This machine as `shardwise train` uses it without a GPU: `workers` processes ("devices",
    2 by default) sharing the machine's memory (read from the OS, split evenly), each with the
    matmul throughput shardwise's CPU probe measured and cached (`shardwise.telemetry.peak`, keyed
    by threads = cores / workers, at least 1; `CPU_DEFAULT_GFLOPS` when no probe is cached yet;
    bf16/fp16 take the fp32 figure unless a probe of their own is cached). More workers than
    cores share them: each gets cores / workers of the one-thread figure (world 4 on 2 cores:
    half). Links: gloo over loopback TCP as measured on this project's 2-core machine
    (../shared/TORCH_ON_CPU.md: all-reduce of 4 KB 0.9 ms and of 4 MB 14 ms at world 2, i.e.
    0.45 ms per ring step and 0.32 GB/s once `CostParams.bandwidth_efficiency` is applied), each
    step's latency stretched by workers / cores when the workers outnumber the cores (world 4
    measured 6.5 ms for 4 KB: 1.1 ms per step); between machines 10 GbE (1.25 GB/s), 50 µs.
    `shardwise plan --calibrate` fits compute efficiency and overlap on top of these."""
    total = _physical_memory_bytes()
    cores = os.cpu_count() or CPU_DEVICES
    threads = max(1, cores // workers)
    share = min(1.0, cores / workers)
    fp32 = _cached_cpu_probe("fp32", threads) or CPU_DEFAULT_GFLOPS * 1e9
    peaks = {p: (_cached_cpu_probe(p, threads) or fp32) * share / 1e12 for p in ("bf16", "fp16")}
    fp32 *= share
    return ClusterSpec(
        ClusterSection(nodes=1, devices_per_node=workers,
                       device_memory_gib=round(total / workers / 2**30, 2), nics_per_node=1,
                       name="cpu-local", device="cpu"),
        PeakSection(fp32=fp32 / 1e12, bf16=peaks["bf16"], fp16=peaks["fp16"], tf32=0.0),
        LinkSection(bandwidth_gbs=round(GLOO_LOOPBACK_GBS / 0.85, 3),
                    latency_us=GLOO_STEP_US * max(1.0, workers / cores)),
        LinkSection(bandwidth_gbs=1.25, latency_us=50.0))


def _physical_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 8.0 * 2**30


def _cache_dir() -> Path:
    return cache_root()


def _cached_cpu_probe(dtype: str, threads: int) -> float | None:
    """The best cached CPU probe for `dtype` at `threads` threads (any torch version), read as
    plain JSON so the planner needs no torch."""
    best = None
    try:
        files = list((_cache_dir() / "peak-flops").glob("cpu-*.json"))
    except OSError:
        return None
    for path in files:
        try:
            entry = json.loads(path.read_text())
            key = entry["key"]
            if key.get("dtype") == dtype and key.get("threads") == threads:
                flops = float(entry["flops"])
                best = flops if best is None or flops > best else best
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return best


PRESETS: dict[str, Callable[[], ClusterSpec]] = {
    "cpu-local": cpu_local,
    "dgx-h100": dgx_h100,
    "h200-nvl8": h200_nvl8,
    "dgx-b200": dgx_b200,
    "a100-80g": a100_80g,
}


def presets() -> dict[str, ClusterSpec]:
    return {name: make() for name, make in PRESETS.items()}


def resolve_cluster(name_or_path: str, nodes: int | None = None) -> ClusterSpec:
    """A preset by name, or a cluster TOML file; `nodes` replaces its node count."""
    if name_or_path in PRESETS:
        spec = PRESETS[name_or_path]()
    elif name_or_path.endswith(".toml") or os.sep in name_or_path or Path(name_or_path).exists():
        spec = load_cluster(name_or_path, presets=presets())
    else:
        raise SpecError(f"--cluster {name_or_path!r} is neither a preset nor a .toml file."
                        f"{_suggest(name_or_path, PRESETS)} Presets: {', '.join(PRESETS)}.")
    if nodes is not None:
        if nodes < 1:
            raise SpecError(f"--nodes {nodes}: a cluster needs at least one node.")
        spec = spec.with_nodes(nodes)
    return spec
