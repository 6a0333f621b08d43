"""Context parallel at a fixed sequence length: per-rank activation memory, step time and K/V
bytes on the wire against the theoretical ring volume, for cp = N in {1, 2, 4}.

N = 1 is the built-in GPT on the whole sequence (SDPA, no process group). N > 1 runs N spawned
ranks on gloo, each with its zigzag chunks (T/N tokens), the model's attention swapped for ring
attention exactly as `parallelize` does (`apply_context_parallel`), forward + backward of the
cross entropy of its chunk. Measured per rank:
- activation bytes: the unique storages autograd saves for backward during the forward (what
  the forward leaves alive for backward; transient blocks inside attention are not included),
- step time: forward + backward, median of `--repeats` after one warm-up, slowest rank,
- wire bytes: what the cp group sent per step (K/V forward and backward, dK/dV backward),
  against the ring's volume: per layer (N-1) K/V blocks forward, (N-1) K/V blocks and N fp32
  dK/dV blocks backward, a block being 2 x B x H_kv x T/N x D values.
Threads per rank: cores / N (>= 1) — step times at different N share 2 cores differently, so
they show the cost of the ring's arithmetic and hops on this machine, not a speed-up.

    python benchmarks/bench_cp.py                      # T = 2048, ~2 min on 2 idle cores
    python benchmarks/bench_cp.py --seq-len 512 --repeats 2 --output /tmp/cp.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.models import build_model
from shardwise.models.plan import plan_of
from shardwise.parallel.context import apply_context_parallel
from shardwise.spec.model import ModelSection

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rank harness: tests/support
from tests.support.ranks import run_ranks


def _saved_bytes(fn) -> tuple[Any, int]:
    """Run fn(); the bytes of the unique storages autograd saved for backward meanwhile."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def _measure(args: argparse.Namespace, cp: int, rank: int, group: Any) -> dict[str, Any]:
    model = build_model(ModelSection.of(n_layers=args.layers, d_model=args.d_model,
                                     n_heads=args.heads, n_kv_heads=args.kv_heads),
                        vocab_size=args.vocab, seq_len=args.seq_len, seed=0)
    plan = plan_of(model)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen)
    context = None
    extra: dict[str, torch.Tensor] = {}
    if cp > 1:
        context = apply_context_parallel([model], plan, group, rank, cp, args.comm)
        tokens, targets, extra = context.shard(tokens, targets)

    def step() -> int:
        with context.active() if context is not None else contextlib.nullcontext():
            logits, saved = _saved_bytes(lambda: model(tokens, **extra))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()
        model.zero_grad(set_to_none=True)
        return saved

    step()  # warm-up
    times, sent = [], []
    for _ in range(args.repeats):
        before = context.cp.sent_bytes if context is not None else 0
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        saved = step()
        times.append(time.perf_counter() - t0)
        sent.append((context.cp.sent_bytes if context is not None else 0) - before)
    if group is not None:  # the slowest rank's time, per repeat
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times = t.tolist()
    return {"saved": saved, "ms": 1e3 * statistics.median(times), "sent": sent[-1],
            "threads": torch.get_num_threads()}


def _rank(store: Any, args: argparse.Namespace, cp: int) -> dict[str, Any]:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cp,
                            timeout=timedelta(seconds=300))
    try:
        return _measure(args, cp, rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def theory_bytes(args: argparse.Namespace, cp: int) -> int:
    """Ring volume per rank per step (all layers), K/V in fp32 like the dK/dV buffers here."""
    if cp == 1:
        return 0
    head_dim = args.d_model // args.heads
    block = 2 * args.batch * args.kv_heads * (args.seq_len // cp) * head_dim * 4
    per_layer = (cp - 1) * block + (cp - 1) * block + cp * block
    if args.comm == "allgather":  # all-gather forward and backward, reduce-scatter of dK/dV
        per_layer = 3 * (cp - 1) * block
    return args.layers * per_layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cps", default="1,2,4")
    p.add_argument("--comm", default="ring", choices=("ring", "allgather"))
    p.add_argument("--output", default="/tmp/helper_cp_results.md")
    args = p.parse_args()
    rows = []
    for cp in (int(c) for c in args.cps.split(",")):
        if cp == 1:
            torch.set_num_threads(os.cpu_count() or 1)
            results = [_measure(args, 1, 0, None)]
        else:
            results = run_ranks(_rank, cp, args, cp, timeout=1200, fresh=True)
        rows.append((cp, results))
        print(cp, results, flush=True)
    base = max(r["saved"] for r in rows[0][1]) if rows[0][0] == 1 else None
    lines = [f"### bench_cp: T = {args.seq_len}, batch {args.batch}, {args.layers} layers, "
             f"d {args.d_model}, {args.heads} heads / {args.kv_heads} K/V heads, "
             f"comm {args.comm}, fp32, gloo, torch {torch.__version__}",
             "",
             "| cp | threads/rank | activation bytes/rank (max) | vs cp1 | step ms (slowest rank) "
             "| wire bytes/rank/step | theory | measured/theory |",
             "|---|---|---|---|---|---|---|---|"]
    for cp, results in rows:
        saved = max(r["saved"] for r in results)
        sent = max(r["sent"] for r in results)
        want = theory_bytes(args, cp)
        ratio = f"{saved / base:.3f}" if base else "-"
        lines.append(f"| {cp} | {results[0]['threads']} | {saved / 2**20:.1f} MiB | {ratio} | "
                     f"{results[0]['ms']:.0f} | {sent / 2**20:.2f} MiB | {want / 2**20:.2f} MiB | "
                     f"{(sent / want if want else 0):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.output, "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
