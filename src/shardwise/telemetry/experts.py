"""Mixture-of-experts figures of a step, for the `step` event (`metrics.jsonl`).

Each MoE module reports its step's routing after the optimizer step (`parallel.expert.end_step`:
per-expert assignments summed over the data-parallel ranks, dropped assignments, tokens x the
Switch balance loss, tokens routed, the selection bias). `summary_row` folds this rank's modules
into a fixed-length row, so rows of every rank can be all-gathered (pipeline stages hold
different layers); `merge_rows` combines them — every rank of a stage (its data-, context- and
tensor-parallel peers) reports the same global figures, so sums are divided by their count. Read
only at log steps (the one host copy).

Fields: `moe_load_min` / `moe_load_mean` / `moe_load_max` (assignments per expert per layer,
over every layer and expert), `moe_load_cv` (coefficient of variation std/mean of the
per-expert load, the mean over layers; 0 = balanced), `moe_dropped` (assignments dropped by the
capacity, all layers) and `moe_dropped_fraction`, `moe_aux_loss` (the Switch loss E * sum f_i P_i
per token, mean over layers; 1.0 = balanced, reported whatever `moe_balance`, unweighted by the
coefficient), `moe_bias_abs_max` / `moe_bias_abs_mean` (the selection bias's drift from 0).
"""

from __future__ import annotations

from typing import Any

import torch

ROW = 11  # layers, sum of cv, min load, max load, assignments, experts, dropped, aux sum,
#           tokens, max |bias|, sum |bias| (over layers x experts)


def summary_row(figures: dict[str, dict[str, Any]] | None) -> list[float]:
    """This rank's MoE modules as one row of ROW floats (zeros without any)."""
    if not figures:
        return [0.0] * ROW
    loads = torch.stack([f["load"].double() for f in figures.values()])  # (layers, E)
    mean = loads.mean(1)
    cv = torch.where(mean > 0, loads.std(1, unbiased=False) / mean.clamp_min(1e-12),
                     torch.zeros_like(mean))
    stats = torch.stack([torch.stack([f["dropped"], f["aux_sum"], f["tokens"]])
                         for f in figures.values()]).double()
    bias = torch.stack([f["bias"].double().abs() for f in figures.values()])
    row = torch.stack([torch.tensor(float(len(figures)), dtype=torch.float64), cv.sum(),
                       loads.min(), loads.max(), loads.sum(),
                       torch.tensor(float(loads.numel()), dtype=torch.float64),
                       stats[:, 0].sum(), stats[:, 1].sum(), stats[:, 2].sum(), bias.max(),
                       bias.sum()])
    return row.tolist()


def merge_rows(rows: list[list[float]], peers: int) -> dict[str, float]:
    """The step's fields from every rank's row; `peers`: the ranks of a stage, which report the
    same figures (see the module docstring)."""
    held = [r for r in rows if r[0] > 0]
    if not held:
        return {}
    total = [sum(r[i] for r in held) / peers for i in range(ROW)]
    layers, assignments, experts = total[0], total[4], total[5]
    tokens = total[8]
    fields = {"moe_load_min": min(r[2] for r in held), "moe_load_max": max(r[3] for r in held),
              "moe_load_mean": assignments / experts, "moe_load_cv": total[1] / layers,
              "moe_dropped": total[6],
              "moe_dropped_fraction": total[6] / assignments if assignments else 0.0,
              "moe_aux_loss": total[7] / tokens if tokens else 0.0,
              "moe_bias_abs_max": max(r[9] for r in held),
              "moe_bias_abs_mean": total[10] / experts}
    return {k: round(v, 6) for k, v in fields.items()}
