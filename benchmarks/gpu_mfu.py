"""GPU throughput: a ~1.3 B-parameter GPT through the ordinary `shardwise train` path, on one GPU.

The run is a plain RunSpec — nothing here is a special code path: bf16 (the one precision policy:
autocast, FSDP gathering Linear weights in bf16, fp32 residual stream, norms and loss), sequence
length 2048, `memory.compile = true` (torch.compile per block), AdamW `implementation = "auto"`
(fused on CUDA), FSDP (`parallel.zero = 3`) on a world-1 group, TF32 for the fp32 parts.

Model: 24 layers, d_model 2048, 16 heads of 128 (no grouped-query attention), SwiGLU FFN 5504
(the default 8/3 d rounded to 64), vocabulary 32,000, untied embeddings: 1.34 B parameters.
Data: 16 M random token ids from a fixed seed, written once as a .npy (`data.source` accepts
token files), so the benchmark measures training steps, not tokenizer training on a small corpus.
Batch: 8 sequences per micro-batch, global batch 16 (two micro-batches per step), 30 steps.

It prints tokens/s (median of the step events after the first window: compile and allocator
warm-up excluded), MFU against the dense bf16 datasheet peak of the GPU (the manifest's formula:
6N + 12·L·H·Q·T/2 per token), the measured matmul probe beside it, and the peak HBM allocated.
Goal: >= 50 % MFU on one H100/H200. About 2-3 minutes (cold compile included).

    python benchmarks/gpu_mfu.py [--steps 30] [--output benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000
MODEL = {"n_layers": 24, "d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "ffn_hidden": 0,
         "tie_embeddings": False}


def spec_overrides(tokens: Path, run_dir: Path, steps: int, micro: int, global_batch: int) -> list[str]:
    values = {
        "run.dir": f'"{run_dir}"', "run.steps": steps, "run.precision": '"bf16"',
        "data.source": f'"{tokens}"', "data.vocab_size": VOCAB, "data.seq_len": 2048,
        "batch.micro_batch": micro, "batch.global_batch": global_batch,
        "parallel.nproc": 1, "parallel.zero": 3, "memory.compile": "true",
        "optimizer.implementation": '"auto"', "optimizer.warmup_steps": 5,
        "eval.every": 0, "eval.batches": 1, "checkpoint.enabled": "false", "sample.tokens": 0,
        "log.every": 5, "log.progress": "false", "log.tensorboard": "false",
        "telemetry.trace_steps": 0,
        **{f"model.{k}": ("true" if v is True else "false" if v is False else v)
           for k, v in MODEL.items()},
    }
    out: list[str] = []
    for key, value in values.items():
        out += ["--set", f"{key}={value}"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--output", help="append a markdown section to this file")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device visible; this benchmark needs one GPU.", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="shardwise-mfu-"))
    tokens = work / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, 16_000_000, dtype=np.int64))
    run_dir = work / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARDWISE_CACHE": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))}
    cmd = [sys.executable, "-m", "shardwise", "train",
           *spec_overrides(tokens, run_dir, args.steps, args.micro_batch, args.global_batch)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
        return proc.returncode
    evs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in evs if e["kind"] == "run_start")
    steps = [e for e in evs if e["kind"] == "step"][1:]  # drop the compile / warm-up window
    tps = statistics.median(e["tokens_per_s"] for e in steps)
    mfu = statistics.median(e["mfu"] for e in steps)
    peak = max(e["peak_mem_bytes"] for e in steps)
    lines = [
        f"## gpu_mfu.py — {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "",
        f"`python benchmarks/gpu_mfu.py --steps {args.steps}` ({time.strftime('%Y-%m-%d')})",
        "",
        "| parameters | seq | tokens/step | tokens/s | MFU (dense bf16 peak) | peak FLOP/s (table / probe) "
        "| peak HBM | wall |",
        "|---|---|---|---|---|---|---|---|",
        f"| {start['model_params'] / 1e9:.2f} B | 2048 | {start['tokens_per_step']:,} | {tps:,.0f} | "
        f"{mfu:.1%} | {start['peak_flops'] / 1e12:.0f} / "
        f"{(start.get('peak_flops_probe') or 0) / 1e12:.0f} TFLOP/s | {peak / 2**30:.1f} GiB | "
        f"{wall:.0f} s |",
        "",
        f"FLOPs per token {start['flops_per_token']:.3e} ({start['flops_formula']}).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
