"""ZeRO-1 under tensor and pipeline parallel (the distributed optimizer, parallel/flat_dp.py)
against ZeRO-2/3 on the same shape: data-parallel bytes per step against the textbook volume,
and step time side by side; ZeRO-1 twice, with one gradient bucket (its reduce-scatter starts
when backward has ended) and with small buckets that start during backward
(parallel/grad_buckets.py).

Each layout trains the same job through `shardwise train` (one launch per layout, the layouts
in turn, repeated `--repeats` times so the machine's drift falls on all of them). What is read
back from the runs' own telemetry (metrics.jsonl):

- data-parallel wire bytes per step: the comm tap's `reduce_scatter` and `all_gather` on the
  `dp_shard` axis (what a ring sends per rank), against the textbook ZeRO-1 volume
  2(N-1)/N x (this rank's parameter bytes), a reduce-scatter of the gradients plus an all-gather
  of the parameters (the `model_state` event gives each rank's parameter bytes);
- step time: the median step time of the counted steps (after `--warmup`), per repeat; the table
  gives the median over repeats and the spread (min-max).

    python benchmarks/bench_zero1.py                          # world 8: tp2 x pp2 x dp2
    python benchmarks/bench_zero1.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {  # name -> parallel overrides (world 8: dp_shard 2 x tp 2 x pp 2)
    "zero1, one bucket": {"zero": 1, "bucket_mb": 1000},
    "zero1, 0.25 MB buckets": {"zero": 1, "bucket_mb": 0.25},
    "zero2": {"zero": 2}, "zero3": {"zero": 3},
}
BASE = ["parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=2", "parallel.pp_schedule=\"1f1b\"",
        "parallel.nproc=8", "model.n_layers=4", "model.tie_embeddings=false",
        "batch.global_batch=16", "batch.micro_batch=2", "data.seq_len=128", "eval.every=0",
        "checkpoint.enabled=false", "sample.tokens=0", "log.every=1", "log.progress=false",
        "log.tensorboard=false"]


def run(layout: str, steps: int, out: Path) -> list[dict]:
    sets = [*BASE, *(f"parallel.{k}={v}" for k, v in LAYOUTS[layout].items()),
            f"run.steps={steps}", f'run.dir="{out}"']
    cmd = [sys.executable, "-m", "shardwise", "train", *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{layout} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def layout_zero(events: list[dict]) -> int:
    return int(next(e for e in events if e["kind"] == "run_start")["zero"])


def figures(events: list[dict], warmup: int) -> dict[str, float]:
    steps = [e for e in events if e["kind"] == "step" and e["step"] > warmup]
    state = next(e for e in events if e["kind"] == "model_state")
    n = 2  # dp_shard
    # this stage's tp-local parameter bytes, whole: ZeRO-1 keeps them whole on every dp rank,
    # ZeRO-2/3 keep 1/n of them
    params = state["param_bytes_per_rank"][0] * (1 if layout_zero(events) == 1 else n)
    dp_wire = statistics.median(
        sum(v["wire_bytes"] for k, v in e["comm_by_op"].items()
            if k in ("reduce_scatter:dp_shard", "all_gather:dp_shard")) for e in steps)
    return {"step_s": statistics.median(e["step_time_s"] for e in steps),
            "dp_wire": dp_wire, "textbook": 2 * (n - 1) / n * params, "params": params}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="bench-zero1-") as tmp:
        for r in range(args.repeats):
            for i, name in enumerate(LAYOUTS):
                results[name].append(figures(run(name, args.steps, Path(tmp) / f"{i}-{r}"),
                                             args.warmup))
    lines = ["| layout (tp2 x pp2 x dp_shard2) | step s, median (min-max) | ratio to zero3 | "
             "dp wire MB/step (rank 0) | textbook MB | measured/textbook |",
             "|---|---|---|---|---|---|"]  # textbook: 2(N-1)/N x whole local parameter bytes
    zero3 = statistics.median(f["step_s"] for f in results["zero3"])
    for name, runs in results.items():
        times = [f["step_s"] for f in runs]
        med = statistics.median(times)
        wire = runs[0]["dp_wire"] / 1e6
        book = runs[0]["textbook"] / 1e6
        # ZeRO-1 and ZeRO-2 send one reduce-scatter of the gradients and one all-gather of the
        # parameters per step; ZeRO-3 re-gathers per micro-batch and stage (no one-line textbook)
        ratio = f"{wire / book:.3f}" if LAYOUTS[name]["zero"] in (1, 2) else "(re-gathers)"
        lines.append(f"| {name} | {med:.3f} ({min(times):.3f}-{max(times):.3f}) | "
                     f"{med / zero3:.2f} | {wire:.2f} | {book:.2f} | {ratio} |")
    print("\n".join(lines))
    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_zero1.py " + shlex.join(argv or sys.argv[1:])
        section = [f"## bench_zero1 {stamp}", "", f"`{command.strip()}`", "",
                   f"- {args.repeats} repeats of each layout in turn, {args.steps} steps each, "
                   f"the first {args.warmup} not counted; world 8 on this machine's CPU cores "
                   "(gloo): the step times are a side-by-side comparison, not throughput",
                   "- ZeRO-2/3 move parameters and gradients with FSDP2 (all-gather per "
                   "micro-batch and stage under ZeRO-3); their dp bytes are listed for scale", "",
                   *lines, ""]
        with args.output.open("a") as f:
            f.write("\n".join(section) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
