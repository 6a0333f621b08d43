"""Will it fit: the planner's memory model for the layout a run is about to start, on the device it
will start on — what `shardwise train` checks before any worker starts (`run.preflight.preflight`).

The capacity per rank is `fit.device_memory_gib` when set; otherwise on a CPU this machine's RAM
shared evenly by the local workers (the `cpu-local` cluster's figure), and on a GPU the device's
total memory when the launcher can read it without initialising CUDA (see
`run.preflight.cuda_device_memory`); when it cannot, there is no check. The prediction is that of
`plan.cost.predict_memory` with the default `CostParams` for the fullest rank (the pipeline rank
holding the most micro-batches, the stage with the output layer): model state, activations,
buffers, the optimizer's workspace, the allocator's share and the runtime's overhead. Imports no
torch: it costs a few milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.planner.cost import DEFAULT_PARAMS, CostParams, predict_memory
from shardwise.planner.layout import Layout, batch_of, layout_of
from shardwise.planner.memory import MemoryBreakdown
from shardwise.planner.models import ModelDims
from shardwise.spec.cluster import GIB


@dataclass(frozen=True)
class FitCheck:
    layout: Layout
    memory: MemoryBreakdown
    rank: int  # the pipeline rank with the most
    capacity_bytes: float
    capacity_source: str  # where the capacity comes from, for the message

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity_bytes

    def numbers(self) -> str:
        m = self.memory
        parts = [("parameters", m.params), ("gathered", m.gathered_params), ("gradients", m.grads),
                 ("optimizer", m.optimizer), ("activations", m.activations),
                 ("buffers", m.buffers), ("optimizer workspace", m.workspace),
                 ("allocator", m.fragmentation), ("runtime", m.overhead)]
        unit, scale = ("GiB", GIB) if max(m.total, self.capacity_bytes) >= GIB else ("MiB", 2**20)
        items = ", ".join(f"{name} {value / scale:.2f}" for name, value in parts
                          if value >= 0.005 * scale)
        where = f"pipeline rank {self.rank}" if self.layout.pp > 1 else "each rank"
        return (f"the memory model predicts {where} of {self.layout.name()} needs "
                f"{m.total / scale:.2f} {unit} ({items}), but {self.capacity_source} gives "
                f"{self.capacity_bytes / scale:.2f} {unit}")


def check_fit(spec: Any, degrees: Any, zero: int, shape: Any, tied: bool, device: str,
              capacity_bytes: float, capacity_source: str,
              params: CostParams = DEFAULT_PARAMS) -> FitCheck:
    """The prediction for `spec` at these resolved degrees (a `ParallelDims`) of a model of this
    `ModelShape` (`ModelDims.from_shape`), against `capacity_bytes` per rank."""
    model = ModelDims.from_shape(shape, name=spec.model.family, tied=tied)
    layout = layout_of(spec, degrees, zero)
    memory, rank = predict_memory(layout, model, batch_of(spec), params, device)
    return FitCheck(layout=layout, memory=memory, rank=rank, capacity_bytes=capacity_bytes,
                    capacity_source=capacity_source)
