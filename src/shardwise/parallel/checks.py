"""Layout checks that need the model shape: refused up front, with the numbers and a valid choice.

`ParallelDims.validate` checks degrees against the world size; this module checks them against
the model, as its plan describes it (which modules tensor parallel splits and their sizes, heads,
blocks), and the batch (micro-batches per pipeline schedule). Imports
no torch, so the planner can call it anywhere.
"""

from __future__ import annotations

from shardwise.errors import SpecError
from shardwise.models.plan import ModelPlan
from shardwise.parallel.dims import ParallelDims
from shardwise.spec.runspec import RunSpec


def _nearest_divisor(n: int, want: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))


def check_layout(spec: RunSpec, dims: ParallelDims, plan: ModelPlan, accumulation: int) -> None:
    """Raise SpecError if the layout cannot run this model (as its plan describes it) and batch."""
    par = spec.parallel
    if dims.tp > 1:
        _check_tensor_parallel(spec, dims, plan)
    if dims.cp > 1:
        _check_context_parallel(spec, dims, plan)
    if dims.ep > 1 or plan.experts:
        _check_experts(spec, dims, plan)
    if dims.pp > 1 and not plan.supports_pp:
        raise SpecError(
            f"pipeline parallel pp = {dims.pp} needs the model's plan to say where a stage is cut "
            f"(`blocks` and `stages`), and {_model_name(spec)} declares "
            f"{'no blocks' if not plan.blocks else 'no stages'}. Use pp = 1 (every data-parallel "
            "layout works without a plan), or add them to the model's plan (see "
            "shardwise.models.plan).")
    if spec.memory.activation_checkpoint != "none" and not plan.blocks:
        raise SpecError(
            f"memory.activation_checkpoint = {spec.memory.activation_checkpoint!r} recomputes "
            f"the model's blocks, and {_model_name(spec)} declares none in its plan. Set it to "
            "\"none\", or name the blocks (`blocks` in the model's plan).")
    if dims.pp > 1:
        _check_pipeline(spec, dims, plan, accumulation)
    elif par.pp_virtual_stages != 1:
        raise SpecError(f"parallel.pp_virtual_stages = {par.pp_virtual_stages} only applies to "
                        "pipeline parallel (pp > 1). Set it to 1.")
    if spec.run.determinism == "invariant":
        _check_invariant(spec, dims, accumulation)


def _model_name(spec: RunSpec) -> str:
    return f"model.family = {spec.model.family!r}"


def _check_tensor_parallel(spec: RunSpec, dims: ParallelDims, plan: ModelPlan) -> None:
    tp = dims.tp
    if not plan.supports_tp and plan.tp_unavailable:
        raise SpecError(f"tensor parallel tp = {tp}: {plan.tp_unavailable}")
    if not plan.supports_tp:
        raise SpecError(
            f"tensor parallel tp = {tp} needs the model's plan to say which modules to split, "
            f"and {_model_name(spec)} declares no tensor-parallel plan. Use tp = 1 (every "
            "data-parallel layout works without a plan), or add `tp` to the model's plan (see "
            "shardwise.models.plan; for a Hugging Face model, model.hf_tp_plan = { \"PATTERN\" "
            "= \"colwise\", ... } over nn.Linear modules).")
    shape = plan.shape
    for what, n in (("the attention heads (n_heads)", shape.heads),
                    ("the key/value heads (n_kv_heads)", shape.kv_heads)):
        _divides(tp, what, n)
    for name, (style, size) in plan.tp_sizes.items():
        if size < 0:
            raise SpecError(
                f"the model's tensor-parallel plan makes {name} {style}, but that module is "
                f"neither a Linear nor (for `embedding`) an Embedding. Change the plan's pattern "
                "so it names only such modules.")
        if style != "sequence":
            _divides(tp, f"the split size of {name} ({style})", size)
    if spec.parallel.sequence_parallel and spec.data.seq_len % tp:
        raise SpecError(
            f"sequence parallel splits each sequence across tp = {tp} ranks, but "
            f"data.seq_len = {spec.data.seq_len} is not a multiple of {tp}. Use a "
            "multiple, or set parallel.sequence_parallel = false."
        )
    if spec.run.precision == "fp16":
        raise SpecError("fp16 with tensor parallel is not supported (loss-scale unscaling of "
                        "DTensor gradients); use run.precision = \"bf16\" or tp = 1.")


def zigzag_seq_lens(seq_len: int, cp: int) -> list[int]:
    """The multiples of 2 * cp nearest `seq_len` (the lengths the zigzag split accepts)."""
    step = 2 * cp
    below = seq_len // step * step
    return sorted({n for n in (below - step, below, below + step, below + 2 * step) if n > 0})


def _check_context_parallel(spec: RunSpec, dims: ParallelDims, plan: ModelPlan) -> None:
    cp, seq_len = dims.cp, spec.data.seq_len
    if not plan.attention or not plan.positions:
        missing = " and ".join(n for n, v in (("`attention`", plan.attention),
                                              ("`positions`", plan.positions)) if not v)
        raise SpecError(
            f"context parallel cp = {cp} replaces the model's attention and passes the true "
            f"token positions, and {_model_name(spec)} declares no {missing} in its plan. Use "
            "cp = 1, or declare them (see shardwise.models.plan).")
    if seq_len % (2 * cp):
        raise SpecError(
            f"context parallel cp = {cp} cuts each sequence into 2 x cp = {2 * cp} equal chunks "
            f"(zigzag load balancing), but data.seq_len = {seq_len} is not a multiple of "
            f"{2 * cp}. Valid lengths near it: {', '.join(map(str, zigzag_seq_lens(seq_len, cp)))}"
            + (f"; or a cp that divides {seq_len // 2}." if seq_len % 2 == 0 else "."))


def _check_experts(spec: RunSpec, dims: ParallelDims, plan: ModelPlan) -> None:
    """Expert parallel needs the plan's experts (and divides them)."""
    ep, experts = dims.ep, plan.shape.experts
    if ep > 1 and not plan.experts:
        raise SpecError(
            f"expert parallel parallel.ep = {ep} places experts on ranks, and "
            f"{_model_name(spec)} declares no `experts` in its plan. Use ep = 1, or a model "
            "with experts (model.family = \"moe-gpt\", or see shardwise.models.plan).")
    if ep > 1 and experts and experts % ep:
        raise SpecError(
            f"expert parallel ep = {ep} does not divide the model's {experts} experts "
            f"({_experts_field(spec)}): every ep rank holds an equal share. The nearest ep that "
            f"does is {_nearest_divisor(experts, ep)}; or use a multiple of {ep} experts.")
    if plan.experts and spec.run.determinism == "invariant":
        raise SpecError(
            f"{_model_name(spec)} has mixture-of-experts layers: determinism = \"invariant\" "
            "does not cover them yet (the experts' gradients are reduced outside its fixed "
            "tree). Use determinism = \"fast\" or \"strict\".")


def _experts_field(spec: RunSpec) -> str:
    """Where the spec sets the number of experts (a Hugging Face model: in its config)."""
    if spec.model.family == "hf":
        return "num_experts / num_local_experts in the Hugging Face config"
    return "model.moe_experts"


def _divides(tp: int, what: str, n: int) -> None:
    if n and n % tp:
        raise SpecError(
            f"tensor parallel tp = {tp} does not divide {what} = {n}: every tp rank must hold "
            f"an equal share. The nearest tp that does is {_nearest_divisor(n, tp)}; or change "
            f"the model so that it is a multiple of {tp}.")


def _check_pipeline(spec: RunSpec, dims: ParallelDims, plan: ModelPlan,
                    accumulation: int) -> None:
    par = spec.parallel
    v, schedule = par.pp_virtual_stages, par.pp_schedule
    stages = dims.pp * v
    if plan.n_blocks < stages:
        raise SpecError(
            f"pp = {dims.pp} x pp_virtual_stages = {v} = {stages} pipeline stages, but the "
            f"model has {plan.n_blocks} blocks: every stage needs at least one. "
            f"Use pp <= {plan.n_blocks // v} or more layers."
        )
    split = par.pp_layer_split
    if split and len(split) != stages:
        raise SpecError(
            f"parallel.pp_layer_split has {len(split)} entries but there are pp x "
            f"pp_virtual_stages = {dims.pp} x {v} = {stages} pipeline stages; give one block "
            "count per stage, or [] for the balanced split.")
    if split and sum(split) != plan.n_blocks:
        raise SpecError(
            f"parallel.pp_layer_split = {list(split)} places {sum(split)} blocks, but the model "
            f"has {plan.n_blocks}. Give block counts that sum to {plan.n_blocks}, or [] for the "
            "balanced split.")
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise SpecError(f"parallel.pp_schedule = {schedule!r} runs one stage per rank; set "
                        f"pp_virtual_stages = 1, or use \"interleaved-1f1b\" for {v} stages per rank.")
    if schedule == "interleaved-1f1b" and v < 2:
        raise SpecError("parallel.pp_schedule = \"interleaved-1f1b\" needs pp_virtual_stages >= 2 "
                        "(stages per rank); set it to 2, or use \"1f1b\".")
    if schedule == "zero-bubble" and v != 2:
        raise SpecError("parallel.pp_schedule = \"zero-bubble\" (ZBV) places exactly 2 stages per "
                        "rank in a V; set parallel.pp_virtual_stages = 2.")
    if schedule != "gpipe" and accumulation < dims.pp:
        raise SpecError(
            f"the {schedule} schedule needs at least pp = {dims.pp} micro-batches per step on each "
            f"data-parallel rank, but global_batch / (micro_batch x dp) = {accumulation}. Raise "
            f"batch.global_batch to {spec.batch.micro_batch * dims.dp * dims.pp} or lower "
            "batch.micro_batch."
        )
    if schedule != "gpipe" and v > 1 and accumulation % dims.pp:
        raise SpecError(
            f"the {schedule} schedule needs a number of micro-batches per step that is a multiple "
            f"of pp = {dims.pp}; it is {accumulation}. Use "
            f"global_batch = {spec.batch.micro_batch * dims.dp * dims.pp * max(1, accumulation // dims.pp)}."
        )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_invariant(spec: RunSpec, dims: ParallelDims, accumulation: int) -> None:
    """What invariant mode guarantees: identical bits across DDP, ZeRO-1/2/3 and HSDP at any
    power-of-two data-parallel degree, for fp32 with a fixed micro-batch size."""
    guarantee = ("determinism = \"invariant\" guarantees identical bits across data-parallel "
                 "layouts (DDP, ZeRO-1/2/3, HSDP) at power-of-two degrees, in fp32")
    if dims.tp > 1 or dims.cp > 1 or dims.pp > 1:
        raise SpecError(
            f"{guarantee}; tp = {dims.tp}, cp = {dims.cp}, pp = {dims.pp} change the arithmetic "
            "(a split matmul or softmax, a schedule's own accumulation order), so they cannot be "
            "bit-invariant. Use determinism = \"fast\" for tolerance-level parity, or "
            "\"strict\" for the same bits run to run at this layout."
        )
    if spec.run.precision != "fp32":
        raise SpecError(f"{guarantee}; run.precision = {spec.run.precision!r} rounds differently "
                        "under FSDP (cast parameters) and elsewhere (autocast). Use fp32.")
    if not _is_power_of_two(dims.dp):
        raise SpecError(f"{guarantee}; the data-parallel degree is {dims.dp}. Use 1, 2, 4, 8, …")
    if not _is_power_of_two(accumulation):
        raise SpecError(
            f"{guarantee}; the micro-batches per rank per step, global_batch / (micro_batch x "
            f"dp) = {accumulation}, must be a power of two too, so that the summation tree is the "
            "same for every degree. Change batch.global_batch or batch.micro_batch."
        )
    if dims.dp_shard > 1 and dims.dp_replicate > 2:
        raise SpecError(f"{guarantee}; HSDP all-reduces across dp_replicate = {dims.dp_replicate} "
                        "replicas in the backend's order, which is a fixed tree only for 2. Use "
                        "dp_replicate <= 2 or a larger dp_shard.")
