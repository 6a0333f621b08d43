"""What checkpoints cost: save/load bandwidth against dd, async stall against step time, restart time.

Three parts (`--parts`, default all):

  bandwidth  FSDP at world 2 (the default layout) in one pair of spawned ranks, after one training
             step so the optimizer state exists. Per model size and repeat, timed between barriers
             on both ranks: a plain `dcp.save` / `dcp.load` of the same components ("raw DCP"),
             shardwise's synchronous save (DCP write + per-file SHA-256 read back + fsync + meta.json
             + rename) and load (find_valid: every file hashed, split across ranks; then load),
             the stall of an async save (the return of `save()`: copy to host memory) and its
             total time to commit. Baseline: `dd` writing the same number of bytes with
             `conv=fsync` into the same directory, and reading them back to /dev/null.
  stall      the default job through the real CLI (`shardwise train`, FSDP on 2 workers) with
             checkpoints every K steps, synchronous vs async vs none, round-robin. Per run: the
             median step time (`step_time_s`, which excludes hooks), the mean stall per save
             (`stall_s` of the checkpoint events), stall / step time, the step right after a save
             (async: it shares the 2 cores with the background write) and the run's wall time.
  restart    the default job through the CLI with `failure.max_restarts=1` and a kill of rank 0 as
             step S enters its data phase. kill -> first step = time of the `restart` event (emitted
             when the first step after the resume has finished) minus the time of the step S-1
             event (rank 0 logs it, then enters step S and is killed). `seconds_to_first_step` of
             the restart event is the restarted process's own share (start to first step).

Page cache: dropping caches needs privileges this machine does not give (/proc/sys/vm/drop_caches
is not writable), so every read here — dd's, DCP's, the hashing — is served from memory: read
figures measure the page cache and the software above it, not the disk. Writes are fsync'd on both
sides, so they do reach the disk.

    python benchmarks/bench_checkpoint.py              # ~5 min on 2 idle cores
    python benchmarks/bench_checkpoint.py --quick      # tiny model, short runs: a smoke run
    python benchmarks/bench_checkpoint.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_step import BENCH_OVERRIDES, append_section, cpu_busy, machine_info, spawn_world

from shardwise.checkpoint.checkpointer import Checkpointer, SaveRecord
from shardwise.checkpoint.storage import Storage
from shardwise.data import prepare_data
from shardwise.parallel.distributed import init_distributed
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog

#: model sizes for the bandwidth part: name -> spec overrides (on top of the spec defaults)
SIZES: dict[str, list[str]] = {
    "default": [],
    "large": ["model.n_layers=8", "model.d_model=512", "model.n_heads=8", "model.n_kv_heads=2"],
}
QUICK_SIZES: dict[str, list[str]] = {
    "tiny": ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
             "model.ffn_hidden=128", "data.seq_len=32", "batch.global_batch=8",
             "batch.micro_batch=2"],
}
#: every CLI run of the default job: no eval, sample or sinks beyond metrics.jsonl
CLI_SETS = ["log.every=1", "log.progress=false", "log.tensorboard=false", "eval.every=0",
            "sample.tokens=0", "telemetry.trace_steps=0"]


# --- part 1: bandwidth ----------------------------------------------------------------------------
@contextmanager
def _timed(rec: dict[str, Any], key: str) -> Iterator[None]:
    """rec[key] = seconds from a barrier to a barrier around the block: the slowest rank's time."""
    dist.barrier()
    t0 = time.perf_counter()
    yield
    dist.barrier()
    rec[key] = time.perf_counter() - t0


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _dd(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args], check=True, capture_output=True)
    return time.perf_counter() - t0


def _bandwidth_rank(rank: int, world: int, specs: dict[str, RunSpec], root: str,
                    repeats: int) -> list[dict[str, Any]]:
    records = []
    for name, spec in specs.items():
        records += _bandwidth_size(rank, name, spec, Path(root) / name, repeats)
    return records if rank == 0 else []


def _bandwidth_size(rank: int, name: str, spec: RunSpec, base: Path, repeats: int
                    ) -> list[dict[str, Any]]:
    ctx = init_distributed(spec.parallel)  # reuses the harness's process group
    trainer = Trainer(spec, ctx, base / "run", prepare_data(spec.data),
                      EventLog("bench", rank, []))
    steps = trainer.steps()
    next(steps)  # one step: parameters and AdamW moments exist
    steps.close()
    trainer.monitors.close()  # the comm tap would count (and slow) the checkpoint collectives
    components = trainer.components()
    sync = Checkpointer(base / "sync", rank, True, storage=Storage(base / "sync"))
    asyn = Checkpointer(base / "async", rank, True, storage=Storage(base / "async"),
                        async_save=True, timeout_s=300)
    records = []
    for r in range(repeats):
        got: list[SaveRecord] = []
        rec: dict[str, Any] = {"size": name, "repeat": r, "params": trainer.num_params}
        raw = base / f"raw-{r}"
        with _timed(rec, "raw_save"):
            dcp.save(components, checkpoint_id=str(raw))
        with _timed(rec, "save"):
            sync.save(r + 1, components, {}, on_committed=got.append)
        with _timed(rec, "async_total"):
            t0 = time.perf_counter()
            asyn.save(r + 1, components, {}, on_committed=got.append)
            rec["async_stall"] = time.perf_counter() - t0
            asyn.wait()
        with _timed(rec, "raw_load"):
            dcp.load(components, checkpoint_id=str(raw))
        with _timed(rec, "verify"):
            found, _ = sync.find_valid()
        with _timed(rec, "load"):
            sync.load(found, components)
        rec["bytes"] = got[0].bytes
        if rank == 0:
            rec["raw_bytes"] = _dir_bytes(raw)
            target, mib = base / "dd.bin", -(-got[0].bytes // (1 << 20))
            rec["dd_bytes"] = mib << 20
            rec["dd_write"] = _dd(["if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}",
                                   "conv=fsync"])
            rec["dd_read"] = _dd([f"if={target}", "of=/dev/null", "bs=1M"])
            target.unlink()
            for path in (raw, *sync.candidates(), *asyn.candidates()):
                shutil.rmtree(path)
            print(f"  {name} repeat {r + 1}: save {rec['save']:.2f} s, load "
                  f"{rec['verify'] + rec['load']:.2f} s, dd write {rec['dd_write']:.2f} s, "
                  f"{rec['bytes'] / 1e6:.0f} MB", flush=True)
        dist.barrier()
        records.append(rec)
    return records


def bandwidth_table(records: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | params | checkpoint MB | what | write s | write MB/s | read s | read MB/s "
             "| vs dd (write, read) |", "|---|---|---|---|---|---|---|---|---|"]
    for size in dict.fromkeys(r["size"] for r in records):
        rows = [r for r in records if r["size"] == size]

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        mb, raw_mb, dd_mb = med("bytes") / 1e6, med("raw_bytes") / 1e6, med("dd_bytes") / 1e6
        dd_w, dd_r = dd_mb / med("dd_write"), dd_mb / med("dd_read")
        head = f"| {size} | {rows[0]['params'] / 1e6:.1f} M | {mb:.1f} "
        for what, w_s, r_s, size_mb in (
                ("shardwise (hash + fsync + commit; verify + load)", med("save"),
                 med("verify") + med("load"), mb),
                ("raw `dcp.save` / `dcp.load`", med("raw_save"), med("raw_load"), raw_mb),
                ("`dd` bs=1M (conv=fsync; to /dev/null)", med("dd_write"), med("dd_read"), dd_mb)):
            w_bw, r_bw = size_mb / w_s, size_mb / r_s
            ratio = "1" if what.startswith("`dd`") else f"{w_bw / dd_w:.2f}, {r_bw / dd_r:.3f}"
            lines.append(f"{head}| {what} | {w_s:.3f} | {w_bw:.0f} | {r_s:.3f} | {r_bw:.0f} "
                         f"| {ratio} |")
        lines.append(f"{head}| async save: stall (copy to host) / time to commit | "
                     f"{med('async_stall'):.3f} / {med('async_total'):.3f} | | | | |")
        lines.append(f"{head}| of the load: verify (hash every file) / DCP load | "
                     f"{med('verify'):.3f} / {med('load'):.3f} | | | | |")
    return lines


# --- parts 2 and 3: the default job through the CLI ----------------------------------------------
def cli_run(workdir: Path, sets: list[str]) -> list[dict[str, Any]]:
    """`shardwise train` (the embedded default job) with `--set` overrides; its events."""
    run_dir = workdir / f"run-{time.time_ns()}"
    args = [sys.executable, "-m", "shardwise", "train", "--set", f'run.dir="{run_dir}"']
    for item in [*CLI_SETS, *sets]:
        args += ["--set", item]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=workdir)
    if proc.returncode:
        raise RuntimeError(f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir, ignore_errors=True)
    return events


def stall_run(workdir: Path, mode: str, steps: int, every: int, warmup: int) -> dict[str, Any]:
    ckpt = (["checkpoint.enabled=false"] if mode == "none" else
            ["checkpoint.enabled=true", f"checkpoint.every={every}",
             f"checkpoint.async_save={'true' if mode == 'async' else 'false'}"])
    events = cli_run(workdir, [f"run.steps={steps}", *ckpt])
    step_times = {e["step"]: e["step_time_s"] for e in events if e["kind"] == "step"}
    saves = [e for e in events if e["kind"] == "checkpoint"]
    saved_at = {e["step"] for e in saves}
    after = [t for s, t in step_times.items() if s - 1 in saved_at and s > warmup]
    return {"mode": mode,
            "step": statistics.median(t for s, t in step_times.items() if s > warmup),
            "after_save": statistics.median(after) if after else float("nan"),
            "stall": statistics.mean(e["stall_s"] for e in saves) if saves else 0.0,
            "write": statistics.mean(e["write_s"] for e in saves) if saves else 0.0,
            "saves": len(saves),
            "bytes": saves[0]["bytes"] if saves else 0,
            "wall": next(e["wall_s"] for e in events if e["kind"] == "run_end")}


def stall_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| mode | saves | step ms (median) | stall per save ms | stall / step | background "
             "write ms | step after a save ms | run wall s |", "|---|---|---|---|---|---|---|---|"]
    for mode in ("none", "sync", "async"):
        rows = [r for r in runs if r["mode"] == mode]
        if not rows:
            continue

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            return statistics.median(r[key] for r in rows)

        ratio = f"{med('stall') / med('step'):.3f}" if mode != "none" else "—"
        after = f"{med('after_save') * 1e3:.0f}" if mode != "none" else "—"
        lines.append(f"| {mode} | {rows[0]['saves']} | {med('step') * 1e3:.0f} | "
                     f"{med('stall') * 1e3:.0f} | {ratio} | {med('write') * 1e3:.0f} | {after} | "
                     f"{med('wall'):.1f} |")
    return lines


def restart_run(workdir: Path, steps: int, every: int, kill_step: int) -> dict[str, Any]:
    events = cli_run(workdir, [f"run.steps={steps}", "checkpoint.enabled=true",
                               f"checkpoint.every={every}", "failure.max_restarts=1",
                               f'failure.faults="kill:rank=0:step={kill_step}:phase=data"'])
    # the first attempt's event (the resumed run logs step kill_step - 1 again, later)
    before = min((e for e in events if e["kind"] == "step" and e["step"] == kill_step - 1),
                 key=lambda e: e["time"])
    restart = next(e for e in events if e["kind"] == "restart")
    return {"total": restart["time"] - before["time"],
            "process": restart["seconds_to_first_step"],
            "resumed_from": restart["resumed_from_step"],
            "steps_lost": kill_step - 1 - restart["resumed_from_step"]}


# --- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="bandwidth,stall,restart")
    parser.add_argument("--repeats", type=int, default=3, help="bandwidth repeats (quick 1)")
    parser.add_argument("--runs", type=int, default=2, help="CLI runs per mode (quick 1)")
    parser.add_argument("--steps", type=int, default=30, help="steps of a stall run (quick 8)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every (quick 4)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--output", type=Path, help="append a markdown section to this file")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    sizes = QUICK_SIZES if args.quick else SIZES
    if args.quick:
        args.repeats, args.runs, args.steps, args.every = 1, 1, 8, 4
    info = machine_info()
    t_start = time.perf_counter()
    print("shardwise checkpoints: save/load bandwidth vs dd, async stall, restart time")
    for key, value in info.items():
        print(f"  {key}: {value}")
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:  # same disk as runs/ here
        workdir = Path(tmp)
        if "bandwidth" in parts:
            specs = {name: load_spec(None, [*BENCH_OVERRIDES, *extra]) for name, extra in
                     sizes.items()}
            prepare_data(next(iter(specs.values())).data)  # tokenizer and cache, untimed
            records = spawn_world(2, _bandwidth_rank, (specs, str(workdir), args.repeats),
                                  args.timeout)[0]
            table = bandwidth_table(records)
            lines += ["### Save and load bandwidth (FSDP, world 2, same disk; medians of "
                      f"{args.repeats})", "", *table, ""]
            print("\n".join(table), flush=True)
        if "stall" in parts:
            runs = []
            for _ in range(args.runs):
                for mode in ("none", "sync", "async"):
                    runs.append(stall_run(workdir, mode, args.steps, args.every, warmup=3))
                    print(f"  stall run {mode}: step {runs[-1]['step'] * 1e3:.0f} ms, stall "
                          f"{runs[-1]['stall'] * 1e3:.0f} ms", flush=True)
            table = stall_table(runs)
            checkpoint_mb = max(r["bytes"] for r in runs) / 1e6
            lines += [f"### Async stall vs sync (default job, {args.steps} steps, checkpoint every "
                      f"{args.every}: {checkpoint_mb:.0f} MB; medians of {args.runs} runs per "
                      "mode)", "", *table, ""]
            print("\n".join(table), flush=True)
        if "restart" in parts:
            steps, every, kill = (8, 3, 6) if args.quick else (40, 10, 26)
            results = [restart_run(workdir, steps, every, kill) for _ in range(args.runs)]
            for res in results:
                print(f"  restart: kill -> first step {res['total']:.2f} s (process "
                      f"{res['process']:.2f} s), resumed from step {res['resumed_from']}",
                      flush=True)
            tot = statistics.median(r["total"] for r in results)
            proc = statistics.median(r["process"] for r in results)
            lines += [f"### Restart time (default job, {steps} steps, checkpoint every {every}, "
                      f"rank 0 killed entering step {kill}, max_restarts=1; medians of "
                      f"{len(results)})", "",
                      "| kill -> first step after resume s | of which the new process (start -> "
                      "first step) s | detection, teardown and respawn s | steps redone |",
                      "|---|---|---|---|",
                      f"| {tot:.2f} | {proc:.2f} | {tot - proc:.2f} | {results[0]['steps_lost']} |",
                      "", "- each run: " + ", ".join(f"{r['total']:.2f}" for r in results) + " s", ""]
            print("\n".join(lines[-8:]), flush=True)
    busy_end = cpu_busy()
    after = [f"CPU busy over 1 s after the run (other work): {busy_end}; total wall time "
             f"{time.perf_counter() - t_start:.0f} s",
             "reads are from the page cache (drop_caches is not available here), for dd and "
             "shardwise alike; writes are fsync'd on both sides"]
    noisy = [x for x in (info["CPU busy over 1 s before start (other work)"], busy_end)
             if x.endswith("%") and float(x[:-1]) > 15]
    if noisy:
        after.append("warning: other work was using the CPU, so these timings are noisy; rerun on "
                     "an idle machine before drawing conclusions.")
    print("\n".join(after))
    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_checkpoint.py " + shlex.join(
            sys.argv[1:] if argv is None else argv)
        section = ["", f"## bench_checkpoint {stamp}", "", f"`{command.strip()}`", ""]
        section += [f"- {k}: {v}" for k, v in info.items()]
        section += ["", *lines, *(f"- {x}" for x in after), ""]
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
