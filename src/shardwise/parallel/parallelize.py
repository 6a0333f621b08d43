"""parallelize(model, ctx, parallel, memory, run): the ONE place where a layout is applied to a model.

Order, and why it is fixed:
  1. pipeline split   — decides which layers this rank holds; everything after works per stage
  2. tensor/sequence  — rewrites weights as DTensors on the `tp` axis; must see plain modules
  3. context parallel — swaps the attention core of the plan's `attention` modules for ring
     attention (after TP, which gives each rank its heads; before AC, whose recompute then
     recomputes the ring too); gradients are reduced over dp x cp in step 7
  4. expert parallel  — shards the plan's `experts` modules along dim 0 over ranks borrowed
     from data parallel (parallel/expert.py), before AC and DP: DP must see them as already
     distributed (DDP ignores them; under ZeRO-2/3 FSDP shards them over the remaining
     data-parallel ranks in units of their own)
  5. activation checkpointing — marks whole blocks, after TP has rewritten their insides
  6. compile          — per block, after AC so the recompute is compiled too
  7. data parallel    — FSDP2 / DDP last: FSDP shards whatever parameters it finds (TP DTensors
     become 2-D), DDP registers hooks on the final parameters; zero 0/1 under tp or pp is
     reduced by the optimizers instead (parallel/flat_dp.py), so nothing wraps the parts.

A model built on the meta device (`models.registry.build_deferred`) goes through 1–7 without
memory and is materialised between FSDP and DDP: every tensor already has its final local shape
(TP, FSDP), and DDP has not yet bucketed or broadcast anything. Each rank then rebuilds, from the
recorded build, only what it holds — the same bits as the eager build on every layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.models.deferred import InitRecord, materialize
from shardwise.models.plan import plan_of
from shardwise.parallel.context import apply_context_parallel
from shardwise.parallel.data_parallel import apply_ddp, apply_fsdp, unwrap
from shardwise.parallel.distributed import DistContext
from shardwise.parallel.execution import ParallelModel
from shardwise.parallel.expert import apply_expert_parallel, build_expert_mesh
from shardwise.parallel.invariant import install_on_fsdp
from shardwise.parallel.memory import apply_activation_checkpointing, apply_compile, blocks_of
from shardwise.parallel.pipeline import Pipeline, split_model, stage_ids, stage_layer_counts
from shardwise.parallel.strategies import InvariantStep, PipelineStep, PlainStep, StepStrategy
from shardwise.parallel.tensor_parallel import apply_tensor_parallel
from shardwise.parallel.tied import TiedAcrossStages
from shardwise.spec.layout import MemorySection, ParallelSection
from shardwise.spec.training import RunSection

__all__ = ["ParallelModel", "local_bytes", "parallelize", "unwrap"]


def parallelize(model: nn.Module, ctx: DistContext, par: ParallelSection, memory: MemorySection,
                run: RunSection, accumulation: int, record: InitRecord | None = None
                ) -> ParallelModel:
    """Apply the layout of `ctx.dims` to `model` (built identically on every rank), reading
    only the model's plan, the [parallel] and [memory] sections and the run's precision and
    determinism. With a deferred `record`, `model` is on the meta device and each rank
    materialises only its own tensors, after sharding."""
    dims = ctx.dims
    plan = plan_of(model)
    deferred = record is not None and record.deferred
    if not deferred:
        model = model.to(ctx.device)
    invariant = run.determinism == "invariant"
    if ctx.mesh is None:
        apply_activation_checkpointing(model, plan, memory)
        if memory.compile:
            apply_compile(model, plan)
        if deferred:
            assert record is not None  # deferred implies a record
            materialize([model], record, ctx.device)
        return ParallelModel([model], ctx, run.precision, plan, invariant=invariant,
                             strategy=_step_strategy(invariant, pipeline=False))

    # 1. pipeline split
    ids, n_stages, parts = [0], 1, [model]
    if dims.pp > 1:
        n_stages = dims.pp * par.pp_virtual_stages
        counts = stage_layer_counts(len(blocks_of(model, plan)), n_stages, par.pp_layer_split)
        ids = stage_ids(ctx.mesh["pp"].get_local_rank(), dims.pp, par.pp_virtual_stages,
                        par.pp_schedule)
        parts = [split_model(model, plan, sid, counts) for sid in ids]
        del model
    # 2. tensor + sequence parallel (loss parallel only without pipeline: stage outputs must be
    #    plain tensors for the schedule; and only for shardwise's own cross entropy)
    loss_par = dims.tp > 1 and par.loss_parallel and dims.pp == 1 and plan.loss is None
    if dims.tp > 1:
        for part in parts:
            apply_tensor_parallel(part, plan, ctx.mesh["tp"],
                                  sequence_parallel=par.sequence_parallel, loss_parallel=loss_par)
    # 3. context parallel (every stage: each supplies its own tokens' positions)
    context = None
    if dims.cp > 1:
        cp_mesh = ctx.mesh["cp"]
        context = apply_context_parallel(parts, plan, cp_mesh.get_group(),
                                         cp_mesh.get_local_rank(), dims.cp, par.cp_comm)
        if dims.tp > 1 and par.sequence_parallel:
            context.hidden_seq_split = dims.tp
    # 4. expert parallel (every stage part: the expert mesh is this stage's dp x cp ranks)
    if dims.ep > 1:
        expert_mesh = build_expert_mesh(dims.dp * dims.cp, dims.ep, ctx.device.type, dims.pp,
                                        dims.tp)
        for part in parts:
            apply_expert_parallel(part, plan, expert_mesh, zero_over_edp=dims.zero >= 2)
    # 5. activation checkpointing, 6. compile
    for part in parts:
        apply_activation_checkpointing(part, plan, memory)
        if memory.compile:
            apply_compile(part, plan)
    # tied tensors whose members sit on different stages: found before DDP renames parameters
    tied = TiedAcrossStages.build(parts, ids, n_stages, plan, ctx) if dims.pp > 1 else None
    # 7. data parallel (invariant mode reduces DDP/ZeRO-1 gradients itself, in a fixed tree)
    flat_dp = False
    if dims.dp * dims.cp > 1 or dims.zero >= 2:
        if dims.zero >= 2:  # FSDP2; with tp > 1 the parameters become 2-D (dp, tp) DTensors
            dp_mesh = ctx.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 \
                else ctx.mesh["dp_shard"]
            if ctx.fsdp_cp_mesh is not None:  # cp ranks shard (and sum gradients) like dp ranks
                dp_mesh = ctx.fsdp_cp_mesh
            parts = [apply_fsdp(part, dp_mesh, zero=dims.zero, precision=run.precision,
                                blocks=[b for _, b in blocks_of(part, plan)]) for part in parts]
            if deferred:  # fill the local shards FSDP2 laid out (on meta, no memory yet)
                assert record is not None
                materialize(parts, record, ctx.device)
                deferred = False
            if invariant:
                for part in parts:
                    install_on_fsdp(part)
        elif not invariant and (dims.tp > 1 or dims.pp > 1):
            flat_dp = True  # DDP cannot wrap these: the optimizers reduce (parallel/flat_dp.py)
        elif not invariant:
            if deferred:  # before DDP, which holds the final parameters
                assert record is not None
                materialize(parts, record, ctx.device)
                deferred = False
            parts = [apply_ddp(part, ctx.grad_group(), ctx.device, par.bucket_mb) for part in parts]
    if deferred:
        assert record is not None
        materialize(parts, record, ctx.device)
    if tied is not None:
        tied.resolve(parts)  # FSDP replaced the parameters by sharded ones: look them up again
    pm = ParallelModel(parts, ctx, run.precision, plan, loss_parallel=loss_par,
                       sequence_parallel=dims.tp > 1 and par.sequence_parallel, invariant=invariant,
                       stage_ids=ids, n_stages=n_stages, schedule=par.pp_schedule,
                       tied=tied if tied is not None and tied.groups else None, context=context,
                       strategy=_step_strategy(invariant, pipeline=dims.pp > 1), flat_dp=flat_dp)
    if dims.pp > 1:
        pm.pipeline = Pipeline(parts, ids, n_stages, par.pp_schedule, accumulation,
                               ctx.mesh["pp"], ctx.device, pm.pipeline_loss)
    return pm


def _step_strategy(invariant: bool, pipeline: bool) -> StepStrategy:
    """How a step's micro-batches run, chosen once: invariant mode's fixed tree (data-parallel
    layouts only; check_layout refuses it with pp), the pipeline schedule, or one plain module."""
    if invariant:
        return InvariantStep()
    return PipelineStep() if pipeline else PlainStep()


def local_bytes(tensors) -> int:
    total = 0
    for t in {id(t): t for t in tensors if t is not None}.values():
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
