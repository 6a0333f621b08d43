"""`Prediction`: what `planner.cost.predict` says of one layout (memory itemised, step time and
its terms, throughput, placement), and the names of its time terms."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardwise.planner.layout import Layout
from shardwise.planner.memory import MemoryBreakdown

#: `Prediction.breakdown` keys, in the order `--explain` prints them
TERMS = ("gemm", "attention", "memory_bound", "output_and_loss", "recompute", "tp", "cp", "ep",
         "pp", "dp_fsdp", "bubble", "dp_sync", "param_gather", "optimizer", "overhead")
COMM_TERMS = ("tp", "cp", "ep", "pp", "dp_fsdp", "dp_sync", "param_gather")


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    fits: bool
    memory: MemoryBreakdown  # of the rank with the most
    memory_rank: int
    capacity_bytes: float
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float  # share of the pipeline's time idle
    compute_s: float  # compute per step on the slowest rank, recompute included
    exposed_comm_s: float
    micro_batches: int
    layer_split: tuple[int, ...]
    stage_time_s: tuple[float, ...]  # per pipeline rank, one micro-batch
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per rank per step, by axis
    comm_time_s: dict[str, float] = field(default_factory=dict)  # before overlap
    reason: str = ""
    overhead_s: float = 0.0  # framework overhead exposed per step outside the bubble
    # per step, by OVERHEAD_FIELDS name: how much the step time grows per second of that
    # coefficient (the exposed op counts; 0 where hidden behind a GPU's kernels)
    overhead_counts: dict[str, float] = field(default_factory=dict)
    # seconds per step on the critical path by term (`TERMS`); they sum to step_time_s
    breakdown: dict[str, float] = field(default_factory=dict)
    # per axis: the links its groups run on, and whether the pods' uplinks bound it
    placement: dict[str, str] = field(default_factory=dict)
    pod_bound: tuple[str, ...] = ()

    @property
    def mem_per_rank_bytes(self) -> float:
        return self.memory.total

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = asdict(self.layout)
        out.update(name=self.layout.name(),
                   micro_batches=self.micro_batches, fits=self.fits,
                   mem_per_rank_bytes=self.memory.total, memory=self.memory.as_dict(),
                   memory_rank=self.memory_rank, capacity_bytes=self.capacity_bytes,
                   step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s, mfu=self.mfu,
                   bubble=self.bubble, compute_s=self.compute_s,
                   exposed_comm_s=self.exposed_comm_s, layer_split=list(self.layer_split),
                   stage_time_s=list(self.stage_time_s), comm_bytes=dict(self.comm_bytes),
                   comm_time_s=dict(self.comm_time_s), reason=self.reason,
                   overhead_s=self.overhead_s, overhead_counts=dict(self.overhead_counts),
                   breakdown=dict(self.breakdown), placement=dict(self.placement),
                   pod_bound=list(self.pod_bound))
        return out
