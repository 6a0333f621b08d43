"""Overhead of shardwise's telemetry: step time with everything on vs everything off.

"on" is the default: every collective counted (the comm tap, with the flight recorder writing each
call into its memory-mapped file), the step trace window, per-step compute/comm accounting.
"off" is `telemetry.comm=false, telemetry.trace_steps=0, failure.hang_timeout_s=0`. Both run
shardwise's `Trainer.steps()` (the same loop `bench_step.py` times as "ours") on the same model,
data and layout, alternating on / off R times in the same processes; the figure is the median over
repeats of each repeat's median step time (the slowest rank's), and the goal is on/off <= 1.02.

    python benchmarks/bench_telemetry.py                 # spec-default model, ddp2 + fsdp2 + tp2
    python benchmarks/bench_telemetry.py --quick         # tiny model, a smoke run
    python benchmarks/bench_telemetry.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import statistics
import sys
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
    ours_run,
    spawn_world,
)

from shardwise.data import prepare_data
from shardwise.spec import RunSpec, load_spec

CONFIGS: dict[str, dict[str, Any]] = {
    "ddp2": {"dp_replicate": 2, "dp_shard": 1},
    "fsdp2": {"dp_shard": 2},
    "tp2": {"tp": 2, "dp_shard": 1},
}
OFF = {"telemetry": {"comm": False, "trace_steps": 0}, "failure": {"hang_timeout_s": 0.0}}


def _rank(rank: int, world: int, specs: dict[str, dict[str, RunSpec]], repeats: int,
          warmup: int, steps: int) -> dict[str, dict[str, list[float]]] | None:
    data = prepare_data(next(iter(next(iter(specs.values())).values())).data)
    out: dict[str, dict[str, list[float]]] = {}
    for config, pair in specs.items():
        out[config] = {"on": [], "off": []}
        for repeat in range(repeats):
            for mode in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                gc.collect()
                dist.barrier()
                times, _ = ours_run(pair[mode], data, warmup + steps)
                t = torch.tensor(times, dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                median = statistics.median(t.tolist()[warmup:]) * 1000
                out[config][mode].append(median)
                if rank == 0:
                    print(f"  {config:<6} repeat {repeat + 1} {mode:<3} median {median:7.2f} ms",
                          flush=True)
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", default="ddp2,fsdp2,tp2")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 4)
    steps, warmup = args.steps or (4 if args.quick else 12), 3
    overrides = [*BENCH_OVERRIDES, *(QUICK_OVERRIDES if args.quick else []),
                 f"run.steps={warmup + steps}"]
    base = load_spec(None, overrides)
    configs = args.configs.split(",")
    specs: dict[str, dict[str, RunSpec]] = {}
    for config in configs:
        model = {"tie_embeddings": False} if config.startswith("tp") else {}
        on = base.replace("parallel", nproc=2, **CONFIGS[config])
        on = on.replace("model", **model) if model else on
        off = on
        for section, values in OFF.items():
            off = off.replace(section, **values)
        specs[config] = {"on": on.validate(), "off": off.validate()}
    prepare_data(base.data)  # tokenizer and token arrays cached before the ranks start
    info = machine_info()
    print("shardwise telemetry overhead: step time with telemetry on / off")
    result = spawn_world(2, _rank, (specs, repeats, warmup, steps), timeout=1800)[0]
    rows = ["| config | on (ms) | off (ms) | on / off |", "|---|---|---|---|"]
    for config in configs:
        on, off = (statistics.median(result[config][m]) for m in ("on", "off"))
        rows.append(f"| {config} | {on:.2f} | {off:.2f} | {on / off:.3f} |")
    busy = cpu_busy()
    lines = [f"### Telemetry overhead ({_dt.date.today().isoformat()})", "",
             f"`python benchmarks/bench_telemetry.py {' '.join(argv or sys.argv[1:])}`: "
             f"{repeats} repeats x {steps} timed steps (+{warmup} warmup), world 2 on gloo, "
             f"{'quick model' if args.quick else 'spec-default model'}.", "", *rows, "",
             f"Machine: {info.get('cpu', '?')}; torch {torch.__version__}; CPU busy after the "
             f"run (other work): {busy}.", ""]
    print("\n".join(lines))
    if args.output:
        append_section(args.output, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
