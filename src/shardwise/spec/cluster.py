"""The ClusterSpec: the machines a run is planned for, typed, frozen and validated like the RunSpec.

A cluster is `nodes` x `devices_per_node` identical devices. TOML, one table per section:

    [cluster]
    base = "dgx-h100"          # optional: start from a preset (shardwise.planner.cluster) and change
    name = "my-h100-pod"       #   only what differs; without a base every field below is required
    nodes = 64
    devices_per_node = 8
    device_memory_gib = 79.6   # usable memory per device (what nvidia-smi reports as total)
    nics_per_node = 8          # inter-node NICs per node (one per GPU on a rail-optimised fabric)
    device = "cuda"            # "cuda" or "cpu": what `shardwise plan --write-spec` asks for

    [peak_tflops]              # dense peak per device, TFLOP/s (no 2:4 sparsity)
    fp32 = 66.9                # plain fp32 (CUDA cores)
    tf32 = 494.7               # fp32 matmuls on TF32 tensor cores (0: none; run.tf32 uses them)
    bf16 = 989.4
    fp16 = 989.4

    [intra]                    # inside a node, per device and per direction
    bandwidth_gbs = 450.0      # GB/s (10^9 bytes/s)
    latency_us = 3.4           # per ring step

    [inter]                    # between nodes, per NIC and per direction
    bandwidth_gbs = 50.0       # 400 Gb/s = 50 GB/s
    latency_us = 9.6

    [device]                   # optional: what the kernel-time and energy estimates read
    generation = "hopper"      # "ampere", "hopper" or "blackwell": which kernel efficiencies apply
    memory_bandwidth_gbs = 3350.0
    sms = 132
    power_w = 700.0
    idle_power_w = 80.0

    [topology]                 # optional: pods of full bisection joined at an oversubscription
    pod_nodes = 384            # Llama 3: pods of 3,072 GPUs ...
    pod_oversubscription = 7.0 # ... joined at 1:7
    rails = true

    [cost]                     # optional: what a run costs
    price_per_device_hour = 2.5  # in your currency; 0: no price shown
    pue = 1.2                  # data-centre power usage effectiveness

Loading reuses the RunSpec's TOML reading and coercion (`shardwise.spec.load`): an unknown section
or key is refused with a "did you mean", a wrong type or a non-positive value names the field, and
every message exits `shardwise plan` with code 2. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.checks import at_least as _at_least
from shardwise.spec.checks import choice as _choice
from shardwise.spec.checks import positive as _positive
from shardwise.spec.load import check_tables
from shardwise.spec.toml import build_table as _build_section
from shardwise.spec.toml import read_toml as _read_toml
from shardwise.spec.toml import suggest as _suggest

CLUSTER_DEVICES = ("cuda", "cpu")
GENERATIONS = ("", "ampere", "hopper", "blackwell")
GIB = 2**30


@dataclass(frozen=True)
class ClusterSection:
    """How many devices, how much memory each, how many NICs per node."""

    nodes: int
    devices_per_node: int
    device_memory_gib: float
    nics_per_node: int
    name: str = "custom"
    device: str = "cuda"
    base: str = ""  # the preset a cluster file started from ("" if none)

    def validate(self) -> None:
        for key in ("nodes", "devices_per_node", "device_memory_gib", "nics_per_node"):
            _positive(f"cluster.{key}", getattr(self, key))
        _choice("cluster.device", self.device, CLUSTER_DEVICES)


@dataclass(frozen=True)
class PeakSection:
    """Dense peak TFLOP/s per device by dtype (tf32 = 0: fp32 matmuls have no TF32 path)."""

    fp32: float
    bf16: float
    fp16: float
    tf32: float = 0.0

    def validate(self) -> None:
        for key in ("fp32", "bf16", "fp16"):
            _positive(f"peak_tflops.{key}", getattr(self, key))
        _at_least("peak_tflops.tf32", self.tf32, 0.0)


@dataclass(frozen=True)
class LinkSection:
    """One kind of link: bandwidth per direction (GB/s) and latency per ring step (µs)."""

    bandwidth_gbs: float
    latency_us: float

    def validate(self, section: str = "link") -> None:
        _positive(f"{section}.bandwidth_gbs", self.bandwidth_gbs)
        _at_least(f"{section}.latency_us", self.latency_us, 0.0)


@dataclass(frozen=True)
class DeviceSection:
    """What the kernel-time model and the energy estimate read of one device; 0 or "" means not
    known, and the term that needs it falls back as its field says."""

    generation: str = ""  # `ampere`, `hopper` or `blackwell` (Hopper's fit): kernel model ("": FLOPs only)
    memory_bandwidth_gbs: float = 0.0  # HBM bandwidth, GB/s (0: memory-bound kernels not timed)
    sms: int = 0  # streaming multiprocessors, for GEMM wave quantisation (0: not modelled)
    power_w: float = 0.0  # board power at full load, W (the datasheet's maximum; 0: no energy figure)
    idle_power_w: float = 0.0  # board power while it waits on the network or the pipeline, W

    def validate(self) -> None:
        _choice("device.generation", self.generation, GENERATIONS)
        for key in ("memory_bandwidth_gbs", "power_w", "idle_power_w"):
            _at_least(f"device.{key}", getattr(self, key), 0.0)
        _at_least("device.sms", self.sms, 0)


@dataclass(frozen=True)
class TopologySection:
    """The network beyond one switch: pods with full bisection bandwidth, joined by a layer
    whose uplinks are oversubscribed (Llama 3: pods of 3,072 GPUs at 1:7)."""

    pod_nodes: int = 0  # nodes per pod of full bisection bandwidth (0: the whole cluster is one pod)
    pod_oversubscription: float = 1.0  # downlink to uplink bandwidth between pods (7.0 for 1:7)
    rails: bool = True  # rail-optimised fabric: NIC k of every node on the same leaf switch

    def validate(self) -> None:
        _at_least("topology.pod_nodes", self.pod_nodes, 0)
        _at_least("topology.pod_oversubscription", self.pod_oversubscription, 1.0)


@dataclass(frozen=True)
class CostSection:
    """What an hour of the cluster costs, for `shardwise plan --tokens`."""

    price_per_device_hour: float = 0.0  # price of one device for one hour (0: no price shown)
    pue: float = 1.0  # power usage effectiveness: facility energy over the devices' energy

    def validate(self) -> None:
        _at_least("cost.price_per_device_hour", self.price_per_device_hour, 0.0)
        _at_least("cost.pue", self.pue, 1.0)


@dataclass(frozen=True)
class ClusterSpec:
    """The whole cluster. Build with `cluster_from_dict` / `load_cluster` (or a preset)."""

    cluster: ClusterSection
    peak_tflops: PeakSection
    intra: LinkSection
    inter: LinkSection
    device: DeviceSection = DeviceSection()
    topology: TopologySection = TopologySection()
    cost: CostSection = CostSection()

    def __hash__(self) -> int:  # the planner's cached terms hash it often: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.cluster, self.peak_tflops, self.intra, self.inter, self.device,
                           self.topology, self.cost))
            self.__dict__["_hash"] = cached
        return cached

    def validate(self) -> ClusterSpec:
        self.cluster.validate()
        self.peak_tflops.validate()
        self.intra.validate("intra")
        self.inter.validate("inter")
        self.device.validate()
        self.topology.validate()
        self.cost.validate()
        return self

    # --- what the cost model reads -------------------------------------------------------
    @property
    def name(self) -> str:
        return self.cluster.name

    @property
    def nodes(self) -> int:
        return self.cluster.nodes

    @property
    def devices_per_node(self) -> int:
        return self.cluster.devices_per_node

    @property
    def world(self) -> int:
        return self.cluster.nodes * self.cluster.devices_per_node

    @property
    def memory_bytes(self) -> float:
        return self.cluster.device_memory_gib * GIB

    def peak_flops(self, precision: str, tf32: bool = True) -> float:
        """Dense FLOP/s per device for a run's precision; fp32 matmuls use TF32 tensor cores when
        `tf32` (shardwise's `run.tf32`, default true) and the device has them."""
        p = self.peak_tflops
        if precision == "fp32":
            return (p.tf32 if tf32 and p.tf32 > 0 else p.fp32) * 1e12
        return getattr(p, precision) * 1e12

    @property
    def intra_bytes_per_s(self) -> float:
        return self.intra.bandwidth_gbs * 1e9

    @property
    def inter_bytes_per_s_per_device(self) -> float:
        """Inter-node bandwidth one device gets while every device of its node sends at once:
        the node's NICs shared by its devices."""
        return self.inter.bandwidth_gbs * 1e9 * self.cluster.nics_per_node / self.devices_per_node

    @property
    def memory_bytes_per_s(self) -> float:
        """HBM bandwidth per device, bytes/s (0 when the cluster file does not say)."""
        return self.device.memory_bandwidth_gbs * 1e9

    @property
    def pod_devices(self) -> int:
        """Devices per pod of full bisection bandwidth (the whole cluster when not split)."""
        pod = self.topology.pod_nodes
        return (pod if 0 < pod < self.nodes else self.nodes) * self.devices_per_node

    def with_nodes(self, nodes: int) -> ClusterSpec:
        return dataclasses.replace(self, cluster=dataclasses.replace(self.cluster, nodes=nodes))

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(ClusterSpec)[f.name] for f in dataclasses.fields(ClusterSpec)
}


def cluster_from_dict(data: Mapping[str, Any], origin: str = "the cluster",
                      presets: Mapping[str, ClusterSpec] | None = None) -> ClusterSpec:
    """A validated ClusterSpec from nested mappings (a parsed TOML file). `[cluster] base = NAME`
    starts from the preset NAME of `presets`; without one every field must be given."""
    check_tables(data, _SECTIONS, origin)
    base_name = data.get("cluster", {}).get("base", "")
    merged: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    if base_name:
        presets = presets or {}
        if not isinstance(base_name, str) or base_name not in presets:
            raise SpecError(f"cluster.base = {show(base_name)} in {origin} is not a preset."
                            f"{_suggest(str(base_name), presets)} Presets: {', '.join(presets)}.")
        for name, values in presets[base_name].to_dict().items():
            merged[name].update(values)
    for name, values in data.items():
        merged[name].update(values)
    sections = {}
    for name, cls in _SECTIONS.items():
        known = {f.name for f in dataclasses.fields(cls)}
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [k for k in required if k not in merged[name]]
        unknown = [k for k in merged[name] if k not in known]
        if missing and not unknown:
            raise SpecError(
                f"{origin} does not set {', '.join(f'{name}.{k}' for k in missing)}. Set "
                f"{'it' if len(missing) == 1 else 'them'} in [{name}], or start from a preset "
                "with [cluster] base = \"dgx-h100\" (or another preset) and change only what "
                "differs.")
        sections[name] = _build_section(name, cls, merged[name], origin)
    spec = ClusterSpec(**sections)
    try:
        spec.validate()
    except SpecError as err:
        raise SpecError(f"{origin}: {err}") from None
    if spec.world > 2**40:
        raise SpecError(f"{origin}: {spec.world} devices is not a cluster; check cluster.nodes "
                        "and cluster.devices_per_node.")
    return spec


def load_cluster(path: str | Path, presets: Mapping[str, ClusterSpec] | None = None) -> ClusterSpec:
    """A ClusterSpec from a TOML file (see the module docstring for its tables)."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"cluster file {path} does not exist. Pass a preset name "
                        f"({', '.join(presets or ())}) or an existing .toml cluster file.")
    if path.is_dir():
        raise SpecError(f"cluster path {path} is a directory; pass a .toml cluster file.")
    return cluster_from_dict(_read_toml(path), origin=str(path), presets=presets)


def cluster_to_toml(spec: ClusterSpec) -> str:
    """The cluster as TOML that `load_cluster` reads back to an equal spec."""
    from shardwise.spec.toml import toml_value as _toml_value

    lines = []
    for section, values in spec.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items())
        lines.append("")
    return "\n".join(lines)
