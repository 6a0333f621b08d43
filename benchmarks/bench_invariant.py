"""Step time of determinism = "invariant" vs "fast" on the same job, side by side.

Each configuration trains the default model through the real CLI (`shardwise train`) in both modes,
alternating fast / invariant R times (ABAB) so that drift of a noisy machine hits both alike. The
step time of a run is the median over its steps after warm-up of `step_time_s` (the slowest rank's
time of each step) from the run's own metrics.jsonl.

    python benchmarks/bench_invariant.py            # about 4 minutes on 2 cores
    python benchmarks/bench_invariant.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CONFIGS = {  # name: (workers, --set overrides)
    "zero3-2 (accum 1)": (2, ["parallel.dp_shard=2", "batch.micro_batch=8"]),
    "zero3-2 (accum 2)": (2, ["parallel.dp_shard=2", "batch.micro_batch=4"]),
    "ddp2 (accum 1)": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1", "batch.micro_batch=8"]),
    "zero3-4 (accum 1)": (4, ["parallel.dp_shard=4", "batch.micro_batch=4"]),
}


def run_once(workdir: Path, nproc: int, sets: list[str], mode: str, steps: int, warmup: int) -> float:
    run_dir = workdir / f"run-{time.time_ns()}"
    args = [sys.executable, "-m", "shardwise", "train", "--nproc", str(nproc),
            "--set", f"run.steps={steps}", "--set", f'run.dir="{run_dir}"',
            "--set", f'run.determinism="{mode}"', "--set", "log.every=1",
            "--set", "log.progress=false", "--set", "log.tensorboard=false",
            "--set", "eval.every=0", "--set", "eval.batches=1", "--set", "sample.tokens=0",
            "--set", "checkpoint.enabled=false"]
    for item in sets:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=workdir)
    if proc.returncode:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    times = [e["step_time_s"] for e in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                           .splitlines()) if e["kind"] == "step"]
    return statistics.median(times[warmup:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", help="append a markdown section to this file")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 6, 2, 1
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    lines = [f"## bench_invariant {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             f"- cpu: {cpu}; cores: {os.cpu_count()}; torch {torch.__version__}; "
             f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"- default model (examples/default.toml), global batch 16, {args.steps} steps, "
             f"median step time after {args.warmup}, {args.repeats} repeats per mode (ABAB)", "",
             "| config | fast ms | invariant ms | invariant/fast |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, sets) in CONFIGS.items():
            fast, inv = [], []
            for _ in range(args.repeats):
                fast.append(run_once(Path(tmp), nproc, sets, "fast", args.steps, args.warmup))
                inv.append(run_once(Path(tmp), nproc, sets, "invariant", args.steps, args.warmup))
            f, i = statistics.median(fast), statistics.median(inv)
            lines.append(f"| {name} | {f * 1e3:.1f} | {i * 1e3:.1f} | {i / f:.3f} |")
            print(lines[-1], flush=True)
    lines.append(f"- load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
