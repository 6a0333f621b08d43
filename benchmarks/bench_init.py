"""Start-up host memory per rank: the eager build (every rank builds the whole model, then shards
it) against the meta-device build (`model.init = "meta"`: recorded on the meta device, each rank
materialises only its own shards).

For each configuration and init, a fresh set of spawned ranks (gloo, threads = cores ÷ ranks)
joins a process group, builds the model as the trainer does (`build_model` for eager,
`build_deferred` for meta) and runs it through `shardwise.parallel.parallelize` for real — no
training step. Each rank reports its peak resident memory: `VmHWM` (the process's own
high-water mark, /proc/self/status) and `ru_maxrss`. They differ in one way: Linux carries the
parent's peak into an exec'd child's `ru_maxrss` (a child of an 800 MB process reports at least
800 MB), so a spawned rank's `ru_maxrss` is at least the launching script's peak (~320 MB here);
`VmHWM` is reset at exec. The same peak is measured for a bare `python -c "import torch"`
process: "over bare torch" is the rank's VmHWM minus that (imports of torch.distributed,
shardwise and the process group included, identical for both inits). "local" is the bytes of
parameters and buffers the rank holds after `parallelize`; "same bits" compares a SHA-256 of
every local tensor of the meta build with the eager build's, rank by rank.

The model is the built-in GPT, big enough that parameters dominate: 12 layers, d_model 1024, 16
heads (4 KV heads), FFN 2752, vocabulary 32,000 (tied), 166 M parameters = 664 MB in fp32
(`--set model.n_layers=...` to change it; `--quick` for a tiny smoke run).

    python benchmarks/bench_init.py                    # ~3-4 min on 2 cores
    python benchmarks/bench_init.py --quick            # tiny model: a smoke run, not a measurement
    python benchmarks/bench_init.py --configs zero3-4,tp2 --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_step import append_section, cpu_busy, machine_info

from shardwise.spec import parse_override, spec_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rank harness: tests/support
from tests.support.ranks import run_ranks

CONFIGS: dict[str, tuple[int, dict[str, Any]]] = {
    "zero3-1": (1, {"dp_shard": 1, "zero": 3}),
    "zero3-2": (2, {"dp_shard": 2, "zero": 3}),
    "zero3-4": (4, {"dp_shard": 4, "zero": 3}),
    "tp2": (2, {"tp": 2, "dp_shard": 1}),
}
MODEL = {"n_layers": 12, "d_model": 1024, "n_heads": 16, "n_kv_heads": 4, "ffn_hidden": 2752}
QUICK_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128}
VOCAB, QUICK_VOCAB, SEQ_LEN = 32000, 512, 128
MB = 1e6


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # Linux: KiB


def hwm_mb() -> float:
    """This process's peak RSS since its exec (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    return float("nan")


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / MB


def bare_torch_mb() -> float:
    """Peak RSS of a process that only imports torch."""
    code = ("import torch; print([int(x.split()[1]) for x in open('/proc/self/status') "
            "if x.startswith('VmHWM:')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip()) * 1024 / MB


def _digest(tensors: list[tuple[str, torch.Tensor]]) -> str:
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        local = t._local_tensor if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def measure(store: Any, sections: dict[str, Any], init: str, vocab: int) -> dict[str, Any]:
    """In one rank: process group, build, parallelize; memory and time at each point."""
    from shardwise.data import BatchLayout
    from shardwise.models.registry import build_deferred, build_model
    from shardwise.parallel.distributed import init_distributed, shutdown
    from shardwise.parallel.parallelize import parallelize, unwrap

    out: dict[str, Any] = {"imports_mb": hwm_mb()}
    spec = spec_from_dict(sections).validate()
    ctx = init_distributed(spec.parallel, store)
    try:
        out["group_mb"] = hwm_mb()
        out["threads"] = torch.get_num_threads()
        start = time.perf_counter()
        if init == "meta":
            model, record = build_deferred(spec.model, vocab, SEQ_LEN, spec.run.seed)
            out["fallback"] = record.fallback
        else:
            model, record = build_model(spec.model, vocab, SEQ_LEN, spec.run.seed), None
        out["build_s"] = time.perf_counter() - start
        out["built_mb"] = hwm_mb()
        start = time.perf_counter()
        acc = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch,
                                  ctx.dims.dp).accumulation
        pm = parallelize(model, ctx, spec.parallel, spec.memory, spec.run, acc, record=record)
        del model, record
        gc.collect()
        out["parallelize_s"] = time.perf_counter() - start
        out["peak_mb"] = hwm_mb()
        out["maxrss_mb"] = maxrss_mb()
        out["rss_after_mb"] = rss_mb()
        named = [nt for part in pm.parts for nt in [
            *unwrap(part).named_parameters(), *unwrap(part).named_buffers()]]
        seen = {id(t): t for _, t in named}
        out["local_mb"] = sum(
            (t._local_tensor if hasattr(t, "_local_tensor") else t).nbytes
            for t in seen.values()) / MB
        out["digest"] = _digest(named)
        out["params"] = sum(t.numel() for t in seen.values())
    finally:
        shutdown(clean=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--inits", default="eager,meta")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="S.K=V")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    configs, inits = args.configs.split(","), args.inits.split(",")
    model = dict(QUICK_MODEL if args.quick else MODEL)
    vocab = QUICK_VOCAB if args.quick else VOCAB
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.set:
        section, name, value = parse_override(item)
        overrides.setdefault(section, {})[name] = value
    info = machine_info()
    bare = statistics.median(bare_torch_mb() for _ in range(3))
    wall = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for config in configs:
            world, parallel = CONFIGS[config]
            for init in inits if repeat % 2 == 0 else list(reversed(inits)):
                sections = {
                    "run": {"name": "bench-init", "seed": 1234},
                    "model": {**model, "init": init},
                    "batch": {"global_batch": 8, "micro_batch": 2},
                    "parallel": {**parallel, "nproc": world, "timeout_s": 600},
                }
                for section, values in overrides.items():
                    sections.setdefault(section, {}).update(values)
                t = time.perf_counter()
                ranks = run_ranks(measure, world, sections, init, vocab, timeout=1200, fresh=True)
                print(f"{config} {init} repeat {repeat}: {time.perf_counter() - t:.1f} s, peak "
                      f"{max(r['peak_mb'] for r in ranks):.0f} MB", flush=True)
                rows.append({"config": config, "world": world, "init": init, "ranks": ranks})
    wall = time.perf_counter() - wall
    lines = report(rows, configs, inits, bare, model, vocab, info, wall, args)
    print("\n".join(lines))
    if args.output:
        append_section(args.output, lines)


def report(rows, configs, inits, bare, model, vocab, info, wall, args) -> list[str]:
    params = rows[0]["ranks"][0]["params"] if rows else 0
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = " ".join(shlex.quote(a) for a in ["python", "benchmarks/bench_init.py", *sys.argv[1:]])
    lines = [f"## bench_init {stamp}", "", f"`{cmd}`", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    full_mb = None
    lines += [
        f"- GPT: {model['n_layers']} layers, d_model {model['d_model']}, {model['n_heads']} "
        f"heads ({model['n_kv_heads']} KV), FFN {model['ffn_hidden']}, vocab {vocab} (tied), "
        f"seq {SEQ_LEN}; fp32",
        f"- bare `import torch` process: peak RSS (VmHWM) {bare:.0f} MB (median of 3)",
        "- MB = 10^6 bytes; peak = VmHWM of the rank after parallelize (max over ranks); over "
        "bare torch = peak − the bare process's; after build = VmHWM once the model is built "
        "(eager: the whole model; meta: the recording); ru_maxrss = the same rank's "
        "ru_maxrss (includes the launching script's peak, see bench_init.py); local = "
        "parameters + buffers the rank holds after parallelize; same bits = SHA-256 of every "
        "local tensor equals the eager build's on every rank",
        "",
        "| config | world | init | threads/rank | local MB/rank | peak MB/rank | over bare torch "
        "MB | after imports + group MB | after build MB | ru_maxrss MB | build s | "
        "parallelize s | same bits | fallback |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    digests = {(r["config"], r["init"]): [x["digest"] for x in r["ranks"]] for r in rows}
    for config in configs:
        for init in inits:
            mine = [r for r in rows if r["config"] == config and r["init"] == init]
            if not mine:
                continue
            peaks = [max(x["peak_mb"] for x in r["ranks"]) for r in mine]
            group = [max(x["group_mb"] for x in r["ranks"]) for r in mine]
            built = [max(x["built_mb"] for x in r["ranks"]) for r in mine]
            maxrss = [max(x["maxrss_mb"] for x in r["ranks"]) for r in mine]
            build = [max(x["build_s"] for x in r["ranks"]) for r in mine]
            par = [max(x["parallelize_s"] for x in r["ranks"]) for r in mine]
            first = mine[0]["ranks"]
            local = max(x["local_mb"] for x in first)
            if config == "zero3-1" and init == "eager":
                full_mb = local
            eager = digests.get((config, "eager"))
            same = "—" if init == "eager" or eager is None else (
                "yes" if digests[(config, init)] == eager else "**no**")
            fallback = first[0].get("fallback") or ""
            lines.append(
                f"| {config} | {mine[0]['world']} | {init} | {first[0]['threads']} | "
                f"{local:.0f} | {_span(peaks)} | {_span([p - bare for p in peaks])} | "
                f"{_span(group)} | {_span(built)} | {_span(maxrss)} | {_span(build, 1)} | "
                f"{_span(par, 1)} | {same} | "
                f"{fallback or '—'} |")
    lines += ["", f"- {params / 1e6:.1f} M parameters (rank 0's count after parallelize, "
              "unique tensors)" + (f"; the whole model is {full_mb:.0f} MB" if full_mb else ""),
              f"- CPU busy over 1 s after the run (other work): {cpu_busy()}; total wall time "
              f"{wall:.0f} s", ""]
    return lines


def _span(values: list[float], digits: int = 0) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{digits}f}" if round(lo, digits) == round(hi, digits) else \
        f"{lo:.{digits}f}–{hi:.{digits}f}"


if __name__ == "__main__":
    main()
