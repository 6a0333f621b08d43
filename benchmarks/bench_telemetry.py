"""Overhead of shardwise's communication telemetry: step time with the comm tap on vs off.

"on" counts every collective (op, axis, bytes, time; completion callbacks for asynchronous ones)
and writes each into the flight recorder's memory-mapped file — what a default run does. "off"
is the same Trainer with the tap uninstalled. One Trainer per configuration runs `Trainer.steps()`
(the loop `bench_step.py` times as "ours") in blocks of steps, alternating on / off, in the same
processes: both sides share the model, the data, the process group and the warm caches, so the
ratio isolates the telemetry instead of the noise of rebuilding a trainer. Each step is timed on
both ranks after a barrier, the slowest rank's time counts; the figure is the median over all
steps of a mode (and the mean, as a check). The per-step bookkeeping that runs either way
(a few clock reads) and the trace window (2 steps of a run) are not in the difference. Goal:
on/off <= 1.02.

    python benchmarks/bench_telemetry.py                 # spec-default model: ddp2, fsdp2, tp2
    python benchmarks/bench_telemetry.py --quick         # tiny model, a smoke run
    python benchmarks/bench_telemetry.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import (
    BENCH_OVERRIDES,
    QUICK_OVERRIDES,
    append_section,
    cpu_busy,
    machine_info,
    spawn_world,
)

from shardwise.data import prepare_data
from shardwise.parallel.distributed import init_distributed
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp2": {"dp_replicate": 2, "dp_shard": 1},
    "fsdp2": {"dp_shard": 2},
    "tp2": {"tp": 2, "dp_shard": 1},
}


def _rank(rank: int, world: int, specs: dict[str, RunSpec], blocks: int, per_block: int,
          warmup: int) -> dict[str, dict[str, list[float]]] | None:
    data = prepare_data(next(iter(specs.values())).data)
    out: dict[str, dict[str, list[float]]] = {}
    for config, spec in specs.items():
        ctx = init_distributed(spec.parallel)  # reuses the process group
        with tempfile.TemporaryDirectory(prefix="bench-telemetry-") as run_dir:
            trainer = Trainer(spec, ctx, Path(run_dir), data, EventLog("bench", rank, []))
            tap = trainer.monitors.tap
            steps = trainer.steps()
            for _ in range(warmup):
                next(steps)
            out[config] = {"on": [], "off": []}
            for block in range(blocks):
                mode = "on" if block % 2 == 0 else "off"
                tap.install() if mode == "on" else tap.uninstall()
                times = []
                for _ in range(per_block):
                    dist.barrier()
                    t0 = time.perf_counter()
                    next(steps)
                    times.append(time.perf_counter() - t0)
                t = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
                out[config][mode] += [1000 * x for x in t.tolist()]
            steps.close()
            trainer.monitors.close()
        if rank == 0:
            on, off = (statistics.median(out[config][m]) for m in ("on", "off"))
            print(f"  {config:<6} on {on:7.2f} ms  off {off:7.2f} ms  ratio {on / off:.4f}",
                  flush=True)
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", default="ddp2,fsdp2,tp2")
    parser.add_argument("--blocks", type=int, default=None, help="alternating on/off blocks")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    blocks = args.blocks or (4 if args.quick else 16)
    per_block, warmup = (3 if args.quick else 6), 3
    overrides = [*BENCH_OVERRIDES, *(QUICK_OVERRIDES if args.quick else []),
                 f"run.steps={warmup + blocks * per_block}", "telemetry.trace_steps=0",
                 "failure.hang_timeout_s=0"]
    base = load_spec(None, overrides)
    configs = args.configs.split(",")
    specs: dict[str, RunSpec] = {}
    for config in configs:
        spec = base.replace("parallel", nproc=2, **CONFIGS[config])
        if config.startswith("tp"):
            spec = spec.replace("model", tie_embeddings=False)
        specs[config] = spec.validate()
    prepare_data(base.data)  # tokenizer and token arrays cached before the ranks start
    info = machine_info()
    print("shardwise telemetry overhead: step time with the comm tap on / off")
    result = spawn_world(2, _rank, (specs, blocks, per_block, warmup), timeout=1800)[0]
    rows = ["| config | on (ms, median) | off (ms, median) | on / off (median) | on / off (mean) |",
            "|---|---|---|---|---|"]
    for config in configs:
        on, off = (statistics.median(result[config][m]) for m in ("on", "off"))
        mean = statistics.mean(result[config]["on"]) / statistics.mean(result[config]["off"])
        rows.append(f"| {config} | {on:.2f} | {off:.2f} | {on / off:.4f} | {mean:.4f} |")
    busy = cpu_busy()
    lines = [f"### Telemetry overhead ({_dt.date.today().isoformat()})", "",
             f"`python benchmarks/bench_telemetry.py {' '.join(argv or sys.argv[1:])}`: "
             f"{blocks} alternating blocks x {per_block} steps (+{warmup} warmup) per "
             f"configuration, one Trainer each, world 2 on gloo, "
             f"{'quick model' if args.quick else 'spec-default model'}.", "", *rows, "",
             f"Machine: {info.get('cpu', '?')}; torch {torch.__version__}; CPU busy after the "
             f"run (other work): {busy}.", ""]
    print("\n".join(lines))
    if args.output:
        append_section(args.output, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
