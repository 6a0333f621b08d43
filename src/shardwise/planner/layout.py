"""A candidate layout and the batch it runs, and which layouts are valid for a model and cluster.

The degrees are shardwise's (`shardwise.parallel.dims.ParallelDims`): the world is
dp_replicate x dp_shard x cp x tp x pp; expert parallel borrows its ranks from dp_shard x cp (as
torchtitan does), so it does not enter the product. The rules mirror what `shardwise train`
refuses (`parallel/dims.py`, `parallel/checks.py`) so that every layout the planner returns is one
shardwise would start — except a data-parallel-outermost mesh and context parallel on a
sliding-window model, which the planner costs (published runs use the first) but shardwise does not
run (`not_run_today` says which).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.planner.comm import ORDERS
from shardwise.planner.models import ModelDims
from shardwise.planner.op_checkpoint import UNSUPPORTED, supports_op_checkpoint
from shardwise.spec.cluster import ClusterSpec

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
RECOMPUTE = ("none", "selective", "full")  # what shardwise's runtime runs (and the search tries)
# ... and what the planner also models for other stacks' published runs: "op", torchtitan's
# per-op selective checkpointing (`planner/op_checkpoint.py`)
MODELLED_RECOMPUTE = (*RECOMPUTE, "op")


@dataclass(frozen=True)
class Batch:
    """Sequences per optimizer step, their length, and the run's precision."""

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    tf32: bool = True  # fp32 matmuls on TF32 tensor cores (shardwise's run.tf32 default)

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 0  # 0 DDP, 1 optimizer state sharded, 2 + gradients, 3 + parameters
    tp: int = 1
    pp: int = 1
    schedule: str = "none"  # "none" without pipeline parallel
    v: int = 1  # stages per pipeline rank
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    recompute: str = "none"  # none | selective (every `ac_every`-th block) | full | op (per-op)
    ac_every: int = 2
    sequence_parallel: bool = False
    # mesh order inside out (`planner.comm.ORDERS`): shardwise's pipeline-outermost mesh, or
    # Llama 3's data-parallel-outermost one (modelled; shardwise does not build it)
    order: str = "tp-cp-dp-pp"

    def __hash__(self) -> int:  # hashed by every cached cost term: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.dp_replicate, self.dp_shard, self.zero, self.tp, self.pp,
                           self.schedule, self.v, self.cp, self.ep, self.micro_batch,
                           self.recompute, self.ac_every, self.sequence_parallel, self.order))
            self.__dict__["_hash"] = cached
        return cached

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def micro_batches(self, batch: Batch) -> int:
        """Micro-batches per step on each data-parallel rank (gradient accumulation)."""
        return batch.global_batch // (self.dp * self.micro_batch)

    def pipeline_calls(self, m: int, local_batch: int) -> tuple[int, int]:
        """(micro-batches one call of the pipeline schedule runs, calls per step) of a step of
        `m` micro-batches: one call of all m unless the stack runs gradient accumulation around
        the schedule, `local_batch` sequences a call (`CostParams.pipeline_local_batch`; 0:
        none). Every call fills and drains the pipeline, and under FSDP ends in torch's
        REDUCE_GRAD: the stages' gradients reduce-scattered and their parameters resharded."""
        if self.pp <= 1 or local_batch <= 0:
            return m, 1
        per_call = min(max(local_batch // self.micro_batch, 1), m)
        return per_call, math.ceil(m / per_call)

    def name(self) -> str:
        parts = []
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts.append(f"hsdp{self.dp_replicate}x{self.dp_shard}-z{self.zero}")
        elif self.dp_shard > 1:
            parts.append(f"zero{self.zero}-{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        for axis in ("tp", "cp", "ep"):
            if getattr(self, axis) > 1:
                sp = "sp" if axis == "tp" and self.sequence_parallel else ""
                parts.append(f"{axis}{getattr(self, axis)}{sp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + {"gpipe": "-gpipe", "1f1b": "-1f1b",
                                            "interleaved-1f1b": f"-i{self.v}",
                                            "zero-bubble": "-zbv"}.get(self.schedule, ""))
        if self.order != "tp-cp-dp-pp":
            parts.append("dp-outer")
        return "+".join(parts) or "single"


def layout_of(spec, degrees, zero: int) -> Layout:
    """The Layout a RunSpec runs: `degrees` (anything with dp_replicate, dp_shard, cp, tp, pp as
    attributes or keys: a resolved `ParallelDims`, or the `mesh` of a run_start event) and the
    resolved ZeRO stage; schedule, micro-batch and recompute from the spec."""
    def degree(name: str) -> int:
        value = degrees.get(name, 1) if isinstance(degrees, dict) else getattr(degrees, name, 1)
        return int(value)

    par, pp, tp = spec.parallel, degree("pp"), degree("tp")
    return Layout(dp_replicate=degree("dp_replicate"), dp_shard=degree("dp_shard"), zero=int(zero),
                  tp=tp, pp=pp, cp=degree("cp"), ep=par.ep,
                  schedule=par.pp_schedule if pp > 1 else "none",
                  v=par.pp_virtual_stages if pp > 1 else 1, micro_batch=spec.batch.micro_batch,
                  recompute=spec.memory.activation_checkpoint, ac_every=spec.memory.ac_every,
                  sequence_parallel=par.sequence_parallel and tp > 1)


def batch_of(spec) -> Batch:
    """The Batch a RunSpec trains on."""
    return Batch(global_batch=spec.batch.global_batch, seq_len=spec.data.seq_len,
                 precision=spec.run.precision, tf32=spec.run.tf32)


def layout_problem(layout: Layout, model: ModelDims, cluster: ClusterSpec,
                   batch: Batch) -> str | None:
    """Why `layout` cannot run `model` on `cluster` with `batch` (a short reason), or None."""
    lo = layout
    if lo.world != cluster.world:
        return f"dp_replicate*dp_shard*cp*tp*pp = {lo.world} != world {cluster.world}"
    if min(lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp, lo.cp, lo.ep, lo.v, lo.micro_batch) < 1:
        return "a degree below 1"
    if batch.global_batch % (lo.dp * lo.micro_batch):
        return (f"global batch {batch.global_batch} not divisible by dp x micro_batch = "
                f"{lo.dp * lo.micro_batch}")
    if lo.zero not in (0, 1, 2, 3):
        return f"zero = {lo.zero}"
    if lo.order not in ORDERS:
        return f"mesh order {lo.order!r} (one of {', '.join(ORDERS)})"
    if lo.zero == 0 and lo.dp_shard > 1:
        return "zero 0 (DDP) shards nothing across dp_shard"
    if lo.zero > 0 and lo.dp_shard == 1 and not (lo.world == 1 and lo.zero >= 2):
        return f"zero {lo.zero} needs dp_shard > 1"
    if lo.zero in (0, 1) and lo.dp * lo.cp > 1 and (lo.tp > 1 or lo.pp > 1) and lo.ep > 1:
        return "DDP / ZeRO-1 with tp or pp does not take ep yet (use zero 2/3)"
    if lo.recompute not in MODELLED_RECOMPUTE:
        return f"recompute {lo.recompute!r}"
    if lo.recompute == "op" and not supports_op_checkpoint(model):
        return UNSUPPORTED
    if lo.recompute != "none" and not model.supports_recompute:
        return "activation checkpointing for a model that declares no blocks"
    if model.opaque and (lo.tp > 1 or lo.pp > 1 or lo.cp > 1 or lo.ep > 1 or lo.recompute != "none"):
        return "the model declares no blocks/shape: data parallel only"
    if lo.tp > 1:
        if not model.supports_tp:
            return "the model's plan has no tensor-parallel map"
        for what, n in (("heads", model.heads), ("KV heads", model.kv), ("FFN", model.ffn),
                        ("expert FFN", model.expert_ffn), ("vocabulary", model.vocab)):
            if n and n % lo.tp:
                return f"tp {lo.tp} does not divide the {what} ({n})"
        if lo.sequence_parallel and batch.seq_len % lo.tp:
            return f"sequence parallel: tp {lo.tp} does not divide seq_len {batch.seq_len}"
    elif lo.sequence_parallel:
        return "sequence parallel without tp"
    if lo.cp > 1 and batch.seq_len % (2 * lo.cp):
        return f"cp {lo.cp}: seq_len {batch.seq_len} is not a multiple of 2*cp (load-balanced chunks)"
    if lo.ep > 1:
        if not model.moe:
            return "ep > 1 for a dense model"
        if model.experts % lo.ep:
            return f"ep {lo.ep} does not divide the {model.experts} experts"
        if (lo.dp_shard * lo.cp) % lo.ep:
            return f"ep {lo.ep} does not divide dp_shard*cp = {lo.dp_shard * lo.cp}"
    m = lo.micro_batches(batch)
    if lo.pp == 1:
        if lo.schedule != "none" or lo.v != 1:
            return "a pipeline schedule without pp"
    else:
        if not model.supports_pp:
            return "the model's plan has no pipeline cut"
        if lo.pp * lo.v > model.layers:
            return f"pp*v = {lo.pp * lo.v} stages > {model.layers} layers"
        if lo.schedule in ("gpipe", "1f1b") and lo.v != 1:
            return f"{lo.schedule} runs one stage per rank"
        if lo.schedule == "interleaved-1f1b" and lo.v < 2:
            return "interleaved-1f1b needs v >= 2"
        if lo.schedule == "zero-bubble" and lo.v != 2:
            return "zero-bubble (ZBV) needs v = 2"
        if lo.schedule not in SCHEDULES[1:]:
            return f"schedule {lo.schedule!r}"
        if lo.schedule != "gpipe" and m < lo.pp:
            return f"{lo.schedule} needs >= pp = {lo.pp} micro-batches per step, has {m}"
        if lo.schedule != "gpipe" and lo.v > 1 and m % lo.pp:
            return f"{m} micro-batches is not a multiple of pp = {lo.pp}"
    return None


def not_run_today(layout: Layout, model: ModelDims) -> str | None:
    """Why this version of shardwise would refuse to run `layout` for `model`, in words, or
    None: the planner costs such layouts (published runs use them) but does not write them."""
    if layout.order != "tp-cp-dp-pp":
        return "a data-parallel-outermost mesh (+dp-outer)"
    if layout.cp > 1 and model.window and model.window_layers:
        return (f"context parallel on a sliding-window model (window {model.window}): the ring "
                "runs plain causal attention")
    return None
