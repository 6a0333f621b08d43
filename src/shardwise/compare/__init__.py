"""Controlled comparisons of runs, scaling studies and the leakage audit's arithmetic.

A comparison first decides whether its runs may be compared at all — same data, held-out split,
optimization, budget and evaluation; only infrastructure (layout, precision, kernels, hardware,
code) may differ — and then scores them side by side: held-out loss at equal tokens against the
seed spread, time and tokens to a target loss, throughput, step-time tail, memory,
communication, checkpoints, restarts, energy and cost. Everything is read from what runs left in
their directories (`spec.toml`, `manifest.json`, `metrics.jsonl`); nothing here imports torch, so
a comparison can be made on a laptop from run directories copied off a cluster.
"""

from shardwise.compare.runs import RunData, load_run_data
from shardwise.compare.scorecard import Comparison, compare_runs

__all__ = ["Comparison", "RunData", "compare_runs", "load_run_data"]
