"""Layout checks that need the model shape: refused up front, with the numbers and a valid choice.

`ParallelDims.validate` checks degrees against the world size; this module checks them against
the model (heads, vocabulary, layers) and the batch (micro-batches per pipeline schedule). Imports
no torch, so the planner can call it anywhere.
"""

from __future__ import annotations

from shardwise.errors import SpecError
from shardwise.parallel.dims import ParallelDims
from shardwise.spec.runspec import RunSpec


def _nearest_divisor(n: int, want: int) -> int:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))


def check_layout(spec: RunSpec, dims: ParallelDims, vocab_size: int, accumulation: int) -> None:
    """Raise SpecError if the layout cannot run this model and batch."""
    model, par = spec.model, spec.parallel
    if dims.tp > 1:
        ffn = model.ffn_hidden or (int(8 * model.d_model / 3) + 63) // 64 * 64
        for what, n in (("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
                        ("the vocabulary (data.vocab_size)", vocab_size),
                        ("model.ffn_hidden", ffn), ("model.d_model", model.d_model)):
            if n % dims.tp:
                raise SpecError(
                    f"tensor parallel tp = {dims.tp} does not divide {what} = {n}: every tp rank "
                    f"must hold an equal share. The nearest tp that does is "
                    f"{_nearest_divisor(n, dims.tp)}; or change {what} to a multiple of {dims.tp}."
                )
        if par.sequence_parallel and spec.data.seq_len % dims.tp:
            raise SpecError(
                f"sequence parallel splits each sequence across tp = {dims.tp} ranks, but "
                f"data.seq_len = {spec.data.seq_len} is not a multiple of {dims.tp}. Use a "
                "multiple, or set parallel.sequence_parallel = false."
            )
    if (dims.tp > 1 or dims.pp > 1) and model.tie_embeddings:
        raise SpecError(
            f"model.tie_embeddings = true shares one weight between the embedding and the output "
            f"layer, which tp = {dims.tp} / pp = {dims.pp} place differently. Set "
            "model.tie_embeddings = false for tensor or pipeline parallel runs."
        )
    if dims.pp > 1:
        _check_pipeline(spec, dims, accumulation)
    elif par.pp_virtual_stages != 1:
        raise SpecError(f"parallel.pp_virtual_stages = {par.pp_virtual_stages} only applies to "
                        "pipeline parallel (pp > 1). Set it to 1.")
    if spec.run.determinism == "invariant":
        _check_invariant(spec, dims, accumulation)
    if spec.run.precision == "fp16" and dims.tp > 1:
        raise SpecError("fp16 with tensor parallel is not supported (loss-scale unscaling of "
                        "DTensor gradients); use run.precision = \"bf16\" or tp = 1.")


def _check_pipeline(spec: RunSpec, dims: ParallelDims, accumulation: int) -> None:
    par = spec.parallel
    v, schedule = par.pp_virtual_stages, par.pp_schedule
    stages = dims.pp * v
    if spec.model.n_layers < stages:
        raise SpecError(
            f"pp = {dims.pp} x pp_virtual_stages = {v} = {stages} pipeline stages, but "
            f"model.n_layers = {spec.model.n_layers}: every stage needs at least one layer. "
            f"Use pp <= {spec.model.n_layers // v} or more layers."
        )
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
