"""Tensor-parallel step time: shardwise against two TP baselines written here, side by side.

Configurations (`--configs`, default both):
  tp2          world 2 on gloo, tp = 2
  zero3-2xtp2  world 4 on gloo, FSDP2 over dp_shard = 2 on top of tp = 2 (2-D)

Sides (`--impls`, default all):
  ours-sp      shardwise's Trainer (`Trainer.steps()`), `parallel.sequence_parallel=true`
  ours-nosp    the same with `parallel.sequence_parallel=false` (loss parallel on in both)
  dtensor-sp   the textbook DTensor recipe in a plain loop: `parallelize_module` with
               Colwise/Rowwise/SequenceParallel/PrepareModuleInput, the output kept
               vocabulary-sharded under `loss_parallel()`, `get_total_norm(...).full_tensor()` +
               `clip_grads_with_norm_` (what torchtitan does)
  dtensor-nosp the same plan without sequence parallel (rowwise outputs all-reduced)
  megatron     plain tensors, Megatron/picotron style, written from scratch below: local weight
               shards in column/row-parallel linears, hand-written autograd functions for the
               collectives (identity forward / all-reduce backward at the input of each
               attention, feed-forward and output block; all-reduce forward / identity backward
               after each row-parallel linear), a vocabulary-parallel embedding and a
               vocabulary-parallel cross entropy (2 all-reduces of b·s values per micro-batch)

With zero3-2xtp2 every side gets FSDP2 `fully_shard` over the dp_shard axis with shardwise's plan
(every block but the last resharded after forward, the root kept gathered), so the comparison is
of the tensor-parallel part.

The model is shardwise's built-in GPT built with the same seed on every side (the Megatron side
slices the same full weights), all sides read the same sample indices of the same token arrays
and use AdamW (foreach) with the same LR schedule and global-norm clipping. Threads per process
follow shardwise's rule (cores / ranks). A step's time is the slowest rank's. Sides alternate in
blocks: each repeat runs every side once, in an order rotated per repeat. Reported: the median of
the per-repeat medians and their min–max range, ratios to the faster baseline, the CPU time of a
step (mean over ranks, median over repeats: the work a side does, which moves less than wall time
when other jobs share the cores), and the largest per-step loss difference of each side against
the first (it should be ~1e-5 or less). Sequence parallel is set explicitly per side, whatever
the spec default.

    python benchmarks/bench_tp.py                  # the issue's shape: ~15 min on 2 idle cores
    python benchmarks/bench_tp.py --quick          # tiny smoke run, ~1 min
    python benchmarks/bench_tp.py --configs tp2 --impls ours-sp,megatron --repeats 6
    python benchmarks/bench_tp.py --profile 3      # + per-side torch.profiler op table (rank 0)
    python benchmarks/bench_tp.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_step import (
    BENCH_OVERRIDES,
    append_section,
    cpu_busy,
    machine_info,
    model_line,
    sequence_plan,
    spawn_world,
    tp_plan,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from shardwise.data import BatchLayout, PreparedData, prepare_data
from shardwise.models import build_model
from shardwise.parallel.distributed import init_distributed
from shardwise.run.schedule import lr_at
from shardwise.run.step import StepLog
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog

#: name -> (world size, dp_shard)
CONFIGS: dict[str, tuple[int, int]] = {"tp2": (2, 1), "zero3-2xtp2": (4, 2)}
IMPLS = ("ours-sp", "ours-nosp", "dtensor-sp", "dtensor-nosp", "megatron")
BASELINES = ("dtensor-sp", "dtensor-nosp", "megatron")

#: The issue's shape: Llama-like, 3.43 M parameters (untied embeddings), fp32.
SHAPE_OVERRIDES = [
    "model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=688", "model.tie_embeddings=false", "data.vocab_size=1024",
    "data.seq_len=128", "batch.global_batch=16", "batch.micro_batch=4", "run.precision=fp32",
]
#: --quick: 2 layers, d_model 64, seq 32 (0.2 M parameters), still 2 micro-batches per rank.
QUICK_OVERRIDES = [
    "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
    "model.ffn_hidden=128", "data.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2",
]

Timed = tuple["StepClock", list[float]]  # (step times, global losses)


class StepClock:
    """Wall and CPU seconds of each step. CPU is the training thread's own (`time.thread_time`:
    compute, dispatch, copies, issuing collectives; not time blocked on a peer, nor gloo's
    transport threads): the work a step costs, which moves less than wall time when other work
    shares the machine."""

    def __init__(self, profiler: Any = None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self._t0 = self._c0 = 0.0
        self.profiler = profiler  # started at the second step (the first one warms up)

    def start(self) -> None:
        if self.profiler is not None and len(self.wall) == 1:
            self.profiler.start()
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._t0)
        self.cpu.append(time.thread_time() - self._c0)


# --- meshes ---------------------------------------------------------------------------------------
def baseline_mesh(world: int, dp: int) -> DeviceMesh:
    """The baselines' own mesh: ("dp_shard", "tp"), tp innermost as in shardwise."""
    return init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp_shard", "tp"))


def shard_data_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over dp_shard with shardwise's plan: blocks resharded after forward but the last,
    the root kept gathered; gradients summed (the loss is already a mean over the global batch
    on the baselines, so FSDP's default average over dp is replaced by the loss scale below)."""
    dp_mesh = mesh["dp_shard"]
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


# --- side (a): shardwise --------------------------------------------------------------------------
def ours_run(spec: RunSpec, data: PreparedData, n_steps: int, times: StepClock) -> Timed:
    """shardwise's Trainer driven through `steps()`; losses read after the timed loop."""
    ctx = init_distributed(spec.parallel)
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as run_dir:
        trainer = Trainer(spec, ctx, Path(run_dir), data, EventLog("bench", ctx.rank, []))
        steps, log = trainer.steps(), StepLog(trainer.model)
        for _ in range(n_steps):
            times.start()
            log.add(next(steps))
            times.stop()
        losses = [r.loss for r in log.resolve()]
        steps.close()
        trainer.monitors.close()
        del trainer, steps
    return times, losses


# --- side (b): plain DTensor ----------------------------------------------------------------------
def dtensor_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The textbook plan (`bench_step.tp_plan`, torchtitan's for Llama); without sequence
    parallel, plain Colwise/Rowwise with the output projection's logits kept sharded."""
    if sequence_parallel:
        plan = tp_plan(model.cfg.n_layers)
    else:
        plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(use_local_output=False)}
        for i in range(model.cfg.n_layers):
            for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                         "feed_forward.w3"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attention.wo", "feed_forward.w2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)


def dtensor_clip(params: list[nn.Parameter], max_norm: float) -> None:
    """torch's global-norm clipping on DTensor gradients. Without sequence parallel the norm
    weights' gradients are plain tensors (or, under FSDP, 1-D dp DTensors) beside the linears'
    TP DTensors, and torch's foreach ops refuse the mix: norm and clip per mesh, one total."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)


# --- side (c): Megatron-style plain tensors -------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward (Megatron's f)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (after a row-parallel matmul)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class ColumnParallelLinear(nn.Module):
    """Output features split; the input is replicated (f applied by the caller's block)."""

    def __init__(self, full: nn.Linear, rank: int, tp: int, group: dist.ProcessGroup,
                 copy_input: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(tp, dim=0)[rank].clone())
        self.group, self.copy_input = group, copy_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = _CopyToTP.apply(x, self.group)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Input features split; each rank's partial output all-reduced (g)."""

    def __init__(self, full: nn.Linear, rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(tp, dim=1)[rank].clone())
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Rows of the table split by vocabulary; tokens outside a rank's range give zeros there,
    and the all-reduce (g) sums the one non-zero row per token."""

    def __init__(self, full: nn.Embedding, rank: int, tp: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().chunk(tp, dim=0)[rank].clone())
        self.start = rank * self.weight.shape[0]
        self.group = group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of −log softmax(logits)[target] on vocabulary-sharded logits (N, V/tp):
    one all-reduce (max) for stability, one of (sum exp, target logit) per token."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        logits = logits.float()
        peak = logits.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak.unsqueeze(-1)
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1) * inside
        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), picked])
        dist.all_reduce(stats, group=group)
        ctx.save_for_backward(exp.div_(stats[0].unsqueeze(-1)), index, inside)
        return (stats[0].log() - stats[1]).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, index, -inside.to(g.dtype).unsqueeze(-1))
        return g * grad, None, None, None


def megatron_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Rewrite the GPT in place into Megatron-style plain-tensor tensor parallel, from the same
    full weights. f sits once at each block input (what Megatron's fused QKV / gate-up gets), so
    q/k/v and w1/w3 are plain local matmuls."""
    rank, tp, group = tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group()
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, rank, tp, group)
    model.output = ColumnParallelLinear(model.output, rank, tp, group, copy_input=True)
    for layer in model.layers.values():
        for block, cols, rows in ((layer.attention, ("wq", "wk", "wv"), ("wo",)),
                                  (layer.feed_forward, ("w1", "w3"), ("w2",))):
            for name in cols:
                setattr(block, name, ColumnParallelLinear(getattr(block, name), rank, tp, group,
                                                          copy_input=False))
            for name in rows:
                setattr(block, name, RowParallelLinear(getattr(block, name), rank, tp, group))
            block.register_forward_pre_hook(
                lambda _m, args, g=group: (_CopyToTP.apply(args[0], g), *args[1:]))


def megatron_loss(logits: torch.Tensor, targets: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    start = tp_mesh.get_local_rank() * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(), start,
                                            tp_mesh.get_group())


def megatron_clip(model: nn.Module, max_norm: float, tp_mesh: DeviceMesh) -> None:
    """Global norm: squares of tp-sharded gradients summed on every rank, of tp-replicated ones
    (the norms) on tp rank 0 only; one all-reduce over the world; foreach scaling."""
    grads, counted = [], []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grads.append(g)
        if not name.endswith("norm.weight") or tp_mesh.get_local_rank() == 0:
            counted.append(g)
    sq = torch.stack(torch._foreach_norm(counted, 2)).pow(2).sum()
    dist.all_reduce(sq)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (sq.sqrt() + 1e-6), max=1.0))


# --- the plain loop of sides (b) and (c) ------------------------------------------------------------
def baseline_run(spec: RunSpec, data: PreparedData, impl: str, mesh: DeviceMesh,
                 n_steps: int, times: StepClock) -> Timed:
    torch.manual_seed(spec.run.seed)
    opt_spec = spec.optimizer
    model = build_model(spec.model, data.vocab_size, spec.data.seq_len, spec.run.seed)
    tp_mesh, dp = mesh["tp"], mesh["dp_shard"].size()
    if impl == "megatron":
        megatron_tp(model, tp_mesh)
    else:
        dtensor_tp(model, tp_mesh, sequence_parallel=impl == "dtensor-sp")
    if dp > 1:
        shard_data_parallel(model, mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": opt_spec.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=opt_spec.lr, betas=(opt_spec.beta1, opt_spec.beta2), eps=opt_spec.eps, foreach=True)
    lrs = [lr_at(s, opt_spec, spec.run.steps) for s in range(n_steps)]
    dp_rank = mesh["dp_shard"].get_local_rank()
    plan = sequence_plan(spec, data, dp_rank, dp, n_steps)
    tokens, seq = data.train, spec.data.seq_len
    megatron = impl == "megatron"
    model.train()
    step_losses = []
    for step in range(n_steps):
        times.start()
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        micro = plan[step]
        step_loss = torch.zeros(())
        for i, ids in enumerate(micro):
            rows = np.stack([tokens[s * seq: s * seq + seq + 1] for s in ids]).astype(np.int64)
            buf = torch.from_numpy(rows)
            x, y = buf[:, :-1], buf[:, 1:]
            if dp > 1:
                model.set_requires_gradient_sync(i == len(micro) - 1)
            # this rank's mean token loss; FSDP's default average over dp makes it the global one
            scale = 1.0 / (len(micro) * y.numel())
            with nullcontext() if megatron else loss_parallel():
                logits = model(x)
                if megatron:
                    loss = megatron_loss(logits, y, tp_mesh) * scale
                else:
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(),
                                           reduction="sum") * scale
                loss.backward()
            loss = loss.detach()
            step_loss += loss.full_tensor() if isinstance(loss, DTensor) else loss
        if opt_spec.grad_clip > 0:
            if megatron:
                megatron_clip(model, opt_spec.grad_clip, tp_mesh)
            else:
                dtensor_clip(params, opt_spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.stop()
        step_losses.append(step_loss)
    losses = torch.stack(step_losses).double()
    if dp > 1:  # the global loss, for the check only: after the timed loop
        dist.all_reduce(losses, group=mesh["dp_shard"].get_group())
        losses /= dp
    return times, losses.tolist()


# --- one rank's plan of measurements --------------------------------------------------------------
def side_spec(spec: RunSpec, impl: str) -> RunSpec:
    return spec.replace("parallel", sequence_parallel=impl == "ours-sp").validate()


def run_side(impl: str, spec: RunSpec, data: PreparedData, mesh: DeviceMesh, n: int,
             times: StepClock | None = None) -> Timed:
    times = times if times is not None else StepClock()
    if impl.startswith("ours"):
        return ours_run(side_spec(spec, impl), data, n, times)
    return baseline_run(spec, data, impl, mesh, n, times)


def block_order(impls: Sequence[str], repeat: int) -> list[str]:
    """Every side once per repeat, the order rotated so no side always runs first."""
    k = repeat % len(impls)
    return [*impls[k:], *impls[:k]]


def _rank_main(rank: int, world: int, config: str, spec: RunSpec, impls: list[str],
               repeats: int, warmup: int, steps: int, profile: int) -> dict[str, Any] | None:
    data = prepare_data(spec.data)  # cached by the parent: mmap only
    mesh = baseline_mesh(world, CONFIGS[config][1])
    records = []
    for repeat in range(repeats):
        for impl in block_order(impls, repeat):
            gc.collect()
            dist.barrier()
            times, losses = run_side(impl, spec, data, mesh, warmup + steps)
            wall = torch.tensor(times.wall, dtype=torch.float64)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            cpu = torch.tensor(times.cpu, dtype=torch.float64)
            dist.all_reduce(cpu)  # CPU: the mean over ranks
            timed = [1000.0 * s for s in wall.tolist()[warmup:]]
            cpu_ms = [1000.0 * s / world for s in cpu.tolist()[warmup:]]
            records.append({"impl": impl, "repeat": repeat, "ms": timed, "cpu_ms": cpu_ms,
                            "losses": losses, "threads": torch.get_num_threads()})
            if rank == 0:
                print(f"  {config} repeat {repeat + 1} {impl:<12} median "
                      f"{statistics.median(timed):8.1f} ms, CPU {statistics.median(cpu_ms):7.1f} "
                      f"ms/rank  (loss {losses[-1]:.4f})", flush=True)
    profiles = {impl: profile_side(impl, spec, data, mesh, profile, rank)
                for impl in impls} if profile else {}
    return {"records": records, "profiles": profiles} if rank == 0 else None


def profile_side(impl: str, spec: RunSpec, data: PreparedData, mesh: DeviceMesh, steps: int,
                 rank: int) -> str:
    """torch.profiler over `steps` steps after one warmup step (all ranks profile; rank 0's op
    table is kept): where the CPU time of a step goes, op by op. Self times of collectives
    include time blocked on the peer."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    prof = profile(activities=[ProfilerActivity.CPU])
    run_side(impl, spec, data, mesh, 1 + steps, StepClock(prof))
    prof.stop()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                     max_name_column_width=60) if rank == 0 else ""


# --- report ---------------------------------------------------------------------------------------
def summarize(records: list[dict[str, Any]], impls: list[str]) -> list[dict[str, Any]]:
    per = {impl: [r for r in records if r["impl"] == impl] for impl in impls}
    medians = {impl: [statistics.median(r["ms"]) for r in per[impl]] for impl in impls}
    cpu = {impl: statistics.median([statistics.median(r["cpu_ms"]) for r in per[impl]])
           for impl in impls}
    ref = per[impls[0]]
    mids = {impl: statistics.median(medians[impl]) for impl in impls}
    peers = [mids[i] for i in impls if i in BASELINES]
    best = min(peers) if peers else float("nan")
    rows = []
    for impl in impls:
        dloss = max((abs(a - b) for o, r in zip(per[impl], ref, strict=True)
                     for a, b in zip(o["losses"], r["losses"], strict=True)), default=0.0)
        rows.append({"impl": impl, "ms": mids[impl], "range": (min(medians[impl]),
                                                              max(medians[impl])),
                     "ratio": mids[impl] / best, "dloss": dloss, "cpu": cpu[impl],
                     "threads": per[impl][0]["threads"]})
    return rows


def table(config: str, world: int, accum: int, rows: list[dict[str, Any]]) -> list[str]:
    head = ("| config | world | threads/proc | accum | side | ms/step (median) | range "
            "| ÷ best baseline | CPU ms/step/rank | max abs Δloss vs first |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(f"| {config} | {world} | {r['threads']} | {accum} | {r['impl']} | "
                     f"{r['ms']:.1f} | {r['range'][0]:.1f}–{r['range'][1]:.1f} | "
                     f"{r['ratio']:.3f} | {r['cpu']:.1f} | {r['dloss']:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma-separated subset of {', '.join(IMPLS)} (the first is the "
                             "loss reference)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="blocks: each runs every side once, order rotated (default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 2+2 steps x 2 repeats: a smoke run, not a measurement")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile N steps of each side and print rank 0's "
                             "op table")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="spec override")
    parser.add_argument("--output", type=Path, default=None,
                        help="append a markdown section (tables + machine info) to this file")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds the ranks of one configuration may take in all")
    args = parser.parse_args(argv)

    steps = args.steps if args.steps is not None else (2 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 4)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    impls = [c.strip() for c in args.impls.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS] + [i for i in impls if i not in IMPLS]
    if bad or not configs or not impls or steps < 1 or warmup < 0 or repeats < 1:
        parser.error(f"bad --configs/--impls {bad} or non-positive --steps/--repeats")
    if any(k in os.environ for k in ("RANK", "WORLD_SIZE")):
        parser.error("run this script directly, not under torchrun: it spawns its own ranks")

    overrides = [*BENCH_OVERRIDES, *SHAPE_OVERRIDES, *(QUICK_OVERRIDES if args.quick else []),
                 *args.overrides, f"run.steps={max(warmup + steps, 1 + args.profile)}"]
    base = load_spec(None, overrides)
    info = machine_info()
    t_start = time.perf_counter()
    data = prepare_data(base.data)  # once here, so ranks only memory-map the cache
    params = build_model(base.model, data.vocab_size, base.data.seq_len,
                         base.run.seed).num_params()
    print("shardwise tensor-parallel benchmark: ours vs plain-DTensor and Megatron-style TP")
    for key, value in info.items():
        print(f"  {key}: {value}")
    print(f"  {model_line(base, data, params)}")
    print(f"  {warmup} warmup + {steps} timed steps per run, {repeats} repeats (rotated blocks)")

    lines: list[str] = []
    profiles: dict[str, dict[str, str]] = {}
    for config in configs:
        world, dp = CONFIGS[config]
        spec = base.replace("parallel", nproc=world, tp=world // dp, dp_shard=dp,
                            dp_replicate=1, loss_parallel=True).validate()
        layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, dp)
        out = spawn_world(world, _rank_main,
                          (config, spec, impls, repeats, warmup, steps, args.profile),
                          args.timeout)[0]
        rows = summarize(out["records"], impls)
        lines += [*table(config, world, layout.accumulation, rows), ""]
        profiles[config] = out["profiles"]

    wall = time.perf_counter() - t_start
    load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
    busy_end = cpu_busy()
    after = [f"load average at end: {load_end}; CPU busy over 1 s after the run (other work): "
             f"{busy_end}; total wall time {wall:.0f} s",
             "÷ best baseline > 1 means slower than the faster of the baselines run "
             "(dtensor-*, megatron); ranges are min–max of the per-repeat medians"]
    noisy = [x for x in (info["CPU busy over 1 s before start (other work)"], busy_end)
             if x.endswith("%") and float(x[:-1]) > 15]
    if noisy:
        after.append("warning: other work was using the CPU, so these timings are noisy; "
                     "rerun on an idle machine before drawing conclusions.")
    print()
    print("\n".join(lines))
    print("\n".join(after))
    for config, by_impl in profiles.items():
        for impl, text in by_impl.items():
            print(f"\nprofile {config} {impl} (rank 0, {args.profile} steps + 1 warmup):\n{text}")

    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_tp.py " + shlex.join(sys.argv[1:] if argv is None
                                                                else argv)
        section = [f"## bench_tp {stamp}", "", f"`{command.strip()}`", ""]
        section += [f"- {k}: {v}" for k, v in info.items()]
        section += [f"- {model_line(base, data, params)}",
                    f"- {warmup} warmup + {steps} timed steps per run, {repeats} repeats "
                    "(blocks of every side, order rotated)", "", *lines,
                    *(f"- {x}" for x in after), ""]
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
