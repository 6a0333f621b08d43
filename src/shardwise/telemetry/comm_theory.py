"""Collective volumes, torch-free: the one ring-volume rule (what a rank sends per byte of the
buffer) that the comm tap's `wire_bytes`, the layouts' theoretical minima below and the planner's
alpha-beta costs (`planner/comm.py`) all use; and the minimum bytes a rank sends per step for the
layouts that have a textbook one.

Ring (bandwidth-optimal) volumes, N ranks on the axis, Psi parameters, a micro-batches per rank
per step, gathers in the parameter dtype (bf16 under bf16 precision) and reductions in fp32:
  DDP (zero 0)  all-reduce the gradients once:                   2(N-1)/N * Psi * 4
  ZeRO-1 / -2   reduce-scatter gradients + all-gather parameters: (N-1)/N * Psi * (4 + p)
  ZeRO-3        all-gather forward and backward per micro-batch,
                one reduce-scatter:                              (N-1)/N * Psi * (2a*p + 4)
  TP (Megatron) per layer and micro-batch, 2 all-reduces of b*s*h forward and 2 backward, plus
                the embedding output and output-layer input:     a(8L+4)(N-1)/N * b*s*h * 4
                (L and h the model's own layers and hidden width, from its plan's shape)
Other layouts (pipeline, HSDP, mixed TP x DP, a model whose shape does not give L and h for TP)
return None: their ratio is not reported rather than reported against a made-up minimum.
"""

from __future__ import annotations

from typing import Protocol


def ring_fraction(op: str, n: int) -> float:
    """Bytes one rank sends per buffer byte in a bandwidth-optimal ring of n ranks: all-reduce
    2(n-1)/n; all-gather, reduce-scatter (the buffer is the unsharded size), all-to-all and
    broadcast (n-1)/n; send and p2p 1, recv and barrier 0."""
    if op in ("send", "p2p"):
        return 1.0
    if n <= 1 or op in ("recv", "barrier"):
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


class Degrees(Protocol):
    """The parallel degrees the minima depend on (`parallel.dims.ParallelDims` has them)."""

    dp: int
    dp_replicate: int
    zero: int
    tp: int
    pp: int
    cp: int


def min_wire_bytes(dims: Degrees, precision: str, params: int, accumulation: int,
                   tokens_per_micro_batch: int, layers: int, hidden: int) -> float | None:
    """The textbook minimum of bytes a rank sends per step, or None where there is none."""
    n, a = dims.dp, accumulation
    p = 2 if precision == "bf16" else 4
    if dims.tp == 1 and dims.pp == 1 and dims.cp == 1 and n > 1 and dims.dp_replicate in (1, n):
        ring = ring_fraction("all_gather", n) * params
        if dims.zero == 0:
            return ring_fraction("all_reduce", n) * params * 4
        if dims.zero in (1, 2):
            return ring * (4 + p)
        if dims.zero == 3 and dims.dp_replicate == 1:
            return ring * (2 * a * p + 4)
        return None
    if dims.tp > 1 and dims.dp == 1 and dims.pp == 1 and dims.cp == 1 and layers and hidden:
        per_all_reduce = ring_fraction("all_reduce", dims.tp) * tokens_per_micro_batch * hidden * 4
        return a * (4 * layers + 2) * per_all_reduce
    return None
