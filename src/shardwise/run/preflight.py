"""Every check that needs no worker, made before any worker starts (`shardwise train`, `launch`,
`verify`, `shardwise.train`): the worker count, layout, batch and model checks, the data prepared
and its hashes pinned into the spec, the will-it-fit memory check, and the `--print-placement`
placement print-out."""

from __future__ import annotations

import dataclasses
import sys

from shardwise.data import PreparedData
from shardwise.parallel.dims import ParallelDims
from shardwise.spec.runspec import RunSpec


def with_data_hashes(spec: RunSpec, data: PreparedData) -> RunSpec:
    """The spec with the data and tokenizer hashes filled in, so a later resume can check them."""
    return spec.replace("data", content_hash=data.content_hash, tokenizer_hash=data.tokenizer_hash)


def with_model_tokenizer(spec: RunSpec) -> RunSpec:
    """A model fine-tuned from a directory (`model.hf_path`) reads text with its own tokenizer:
    `data.tokenizer` is set to the directory's tokenizer.json unless the user named one."""
    hf = spec.model.hf
    if hf is None or not hf.hf_path:
        return spec
    from shardwise.data import resolve_tokenizer
    from shardwise.models.hf.build import hf_dir

    return dataclasses.replace(spec, data=resolve_tokenizer(spec.data, hf_dir(hf)))


def preflight(spec: RunSpec, data: PreparedData | None = None) -> tuple[RunSpec, ParallelDims]:
    """Every check that needs no worker, before any worker starts: the worker count against the
    machine's GPUs (and `nproc = 0` resolved to a number), layout against the world size, batch
    against the data-parallel degree, layout against the model; the data is prepared here
    (unless `data`, prepared from the same `spec.data`, is given: `shardwise verify` checks many
    layouts of one job) and its hashes are pinned into the returned spec."""
    from shardwise.data import BatchLayout, prepare_data
    from shardwise.models.registry import describe_model
    from shardwise.parallel.checks import check_layout
    from shardwise.parallel.devices import resolve_backend, resolve_device_type, resolve_nproc
    from shardwise.parallel.support import check_torch_supports
    from shardwise.run.hooks import user_hook_setups

    spec = with_model_tokenizer(spec)
    user_hook_setups(spec.run.hooks)  # a missing hook file fails here, not in every worker
    device_type = resolve_device_type(spec.parallel)
    check_torch_supports(spec.parallel, resolve_backend(spec.parallel, device_type))
    spec = spec.replace("parallel", nproc=resolve_nproc(spec.parallel, device_type))
    dims = ParallelDims.from_spec(spec.parallel, spec.parallel.nproc)
    layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, dims.dp)
    if data is None:  # after the cheap checks: preparing a corpus can take a while
        data = prepare_data(spec.data)
    plan = describe_model(spec.model, data.vocab_size, spec.data.seq_len)
    if dims.cp > 1 and spec.model.hf is not None:
        from shardwise.models.hf.attention import check_context_parallel
        from shardwise.models.hf.build import load_config

        check_context_parallel(load_config(spec.model.hf, data.vocab_size, spec.data.seq_len))
    check_layout(spec, dims, plan, layout.accumulation)
    check_memory(spec, dims, plan, device_type)
    return with_data_hashes(spec, data), dims


def check_memory(spec: RunSpec, dims: ParallelDims, plan, device_type: str) -> None:
    """The will-it-fit check (`shardwise.planner.fit`): one warning line on stderr when the memory
    model predicts a rank will not fit its device; with `fit.strict = true` a UserError (exit 2)
    with the numbers instead. Silent when it fits, and when a GPU's memory cannot be read cheaply."""
    from shardwise.errors import UserError
    from shardwise.planner.cluster import _physical_memory_bytes
    from shardwise.planner.fit import check_fit

    workers = spec.parallel.nproc
    if spec.fit.device_memory_gib > 0:
        capacity = spec.fit.device_memory_gib * 2**30
        source = f"fit.device_memory_gib = {spec.fit.device_memory_gib:g}"
    elif device_type == "cpu":
        total = _physical_memory_bytes()
        capacity = total / workers
        source = (f"this machine's {total / 2**30:.1f} GiB of RAM shared by {workers} local "
                  f"worker{'s' if workers > 1 else ''}")
    else:
        memory = cuda_device_memory()
        if memory is None:
            return
        capacity, source = memory, "the GPU"
    result = check_fit(spec, dims, dims.zero, plan.shape, bool(plan.tied), device_type, capacity,
                       source)
    if result.fits:
        return
    if spec.fit.strict:
        raise UserError(f"{result.numbers()}, and fit.strict = true refuses to start a run "
                        "predicted not to fit. Shard more (a higher parallel.zero, tp or pp), "
                        "checkpoint activations (memory.activation_checkpoint), lower "
                        "batch.micro_batch, or see `shardwise plan --model SPEC.toml --cluster "
                        "...` for layouts that fit; set fit.strict = false to start it anyway.")
    print(f"warning: {result.numbers()}; it may run out of memory (fit.strict = true refuses "
          "such runs; `shardwise plan --model SPEC.toml` lists layouts that fit).",
          file=sys.stderr)


def cuda_device_memory() -> float | None:
    """Total memory of the first GPU, only where reading it costs nothing: from torch when this
    process has initialised CUDA already (initialising it here would cost the launcher seconds and
    a context), else from NVML when `pynvml` is installed; None otherwise."""
    import torch

    if torch.cuda.is_initialized():
        return float(torch.cuda.get_device_properties(0).total_memory)
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            return float(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no device: no check, no message
        return None


def placement_preview(spec: RunSpec, dims: ParallelDims) -> str:
    """What `--print-placement` shows: every parameter's placement under `dims`, the pipeline stage
    map, the FSDP units, the tied groups (the model built on the meta device; after `preflight`,
    so the data is prepared and cached)."""
    from shardwise.data import prepare_data
    from shardwise.models.plan import plan_of
    from shardwise.models.registry import build_model
    from shardwise.parallel.placement import render

    data = prepare_data(spec.data)
    model = build_model(spec.model, data.vocab_size, spec.data.seq_len, seed=0, device="meta")
    return render(model, plan_of(model), dims, spec.parallel.pp_virtual_stages,
                  spec.parallel.pp_schedule, spec.parallel.pp_layer_split)
