"""The theoretical minimum of bytes a rank sends per step, for the layouts that have a textbook one.

Ring (bandwidth-optimal) volumes, N ranks on the axis, Psi parameters, a micro-batches per rank
per step, gathers in the parameter dtype (bf16 under bf16 precision) and reductions in fp32:
  DDP (zero 0)  all-reduce the gradients once:                   2(N-1)/N * Psi * 4
  ZeRO-1 / -2   reduce-scatter gradients + all-gather parameters: (N-1)/N * Psi * (4 + p)
  ZeRO-3        all-gather forward and backward per micro-batch,
                one reduce-scatter:                              (N-1)/N * Psi * (2a*p + 4)
  TP (Megatron) per layer and micro-batch, 2 all-reduces of b*s*h forward and 2 backward, plus
                the embedding output and output-layer input:     a(8L+4)(N-1)/N * b*s*h * 4
Other layouts (pipeline, HSDP, mixed TP x DP) return None: their ratio is not reported rather
than reported against a made-up minimum.
"""

from __future__ import annotations

from shardwise.parallel.dims import ParallelDims
from shardwise.spec.runspec import RunSpec


def min_wire_bytes(spec: RunSpec, dims: ParallelDims, params: int,
                   accumulation: int) -> float | None:
    n, a = dims.dp, accumulation
    p = 2 if spec.run.precision == "bf16" else 4
    if dims.tp == 1 and dims.pp == 1 and dims.cp == 1 and n > 1 and dims.dp_replicate in (1, n):
        ring = (n - 1) / n * params
        if dims.zero == 0:
            return 2 * ring * 4
        if dims.zero in (1, 2):
            return ring * (4 + p)
        if dims.zero == 3 and dims.dp_replicate == 1:
            return ring * (2 * a * p + 4)
        return None
    if dims.tp > 1 and dims.dp == 1 and dims.pp == 1:
        m = spec.model
        tokens = spec.batch.micro_batch * spec.data.seq_len
        return a * (8 * m.n_layers + 4) * (dims.tp - 1) / dims.tp * tokens * m.d_model * 4
    return None
