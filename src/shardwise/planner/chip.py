"""The kernel model's view of a cluster's device (`kernels.Chip`): its peak, HBM bandwidth and
SM count, at the efficiencies fitted for its generation (`CostParams`), or another generation's
where none of its runs is published (`EFFICIENCIES_OF`)."""

from __future__ import annotations

from shardwise.planner.kernels import Chip
from shardwise.planner.layout import Batch
from shardwise.planner.params import CostParams
from shardwise.spec.cluster import ClusterSpec

#: generations whose kernel efficiencies are another's: no published Blackwell bf16 training run
#: is in the reference set to fit its own, so a B200 runs at Hopper's fractions of its own peak,
#: HBM bandwidth and SM count (cuBLAS's large bf16 GEMMs and FlashAttention reach similar
#: fractions of peak on both); the MFU band says none of its runs are Blackwell's
EFFICIENCIES_OF = {"blackwell": "hopper"}


def fitted_efficiencies(params: CostParams, generation: str) -> tuple[float, float, float, str]:
    """(GEMM efficiency, attention efficiency, GEMM fixed cost k0, whose fit they are) for a
    device of `generation` (a known one: `spec.cluster.GENERATIONS`, not "")."""
    basis = EFFICIENCIES_OF.get(generation, generation)
    return (getattr(params, f"gemm_efficiency_{basis}"),
            getattr(params, f"attention_efficiency_{basis}"),
            getattr(params, f"gemm_k_half_{basis}"), basis)


def chip_for(cluster: ClusterSpec, batch: Batch, params: CostParams) -> Chip | None:
    """The kernel model's view of the cluster's device, or None where it does not apply (a CPU,
    or a device of no known generation: FLOPs over `efficiency` x peak instead)."""
    gen = cluster.device.generation
    if cluster.cluster.device == "cpu" or not gen:
        return None
    gemm, attention, k_half, _ = fitted_efficiencies(params, gen)
    return Chip(peak=cluster.peak_flops(batch.precision, batch.tf32), gemm=gemm,
                attention=attention, k_half=k_half, sms=cluster.device.sms,
                hbm=cluster.memory_bytes_per_s)
