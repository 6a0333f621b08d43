"""parallelize(model, ctx): the ONE place where a layout is applied to a model.

Order, and why it is fixed:
  1. pipeline split   — decides which layers this rank holds (not available yet)
  2. tensor/sequence  — rewrites weights as DTensors on the `tp` axis (not available yet)
  3. context parallel — swaps attention for ring attention (not available yet)
  4. expert parallel  — places experts on the `ep` axis (not available yet)
  5. activation checkpointing, 6. compile — wrap blocks after their weights are final
  7. data parallel    — FSDP2 / DDP last, because it must see the final parameters (FSDP shards
     whatever it finds, DDP registers hooks on what exists).
Degrees of the layers that have not landed are refused by `ParallelDims.validate`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.parallel.distributed import DistContext


def parallelize(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Move `model` to the context's device and apply its data-parallel layout."""
    model = model.to(ctx.device)
    if ctx.mesh is None:
        return model
    dims = ctx.dims
    if dims.dp_shard > 1:
        return _apply_fsdp(model, ctx)
    if dims.dp_replicate > 1:
        return _apply_ddp(model, ctx)
    return model


def _apply_fsdp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """FSDP2 (ZeRO-3): each transformer block is one all-gather unit, then the root.

    With dp_replicate > 1 the 2-D mesh makes it HSDP: shard within dp_shard, replicate across
    dp_replicate.
    """
    dims = ctx.dims
    mesh = ctx.mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else ctx.mesh["dp_shard"]
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleDict | nn.ModuleList):
        blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again at once by backward: keep them.
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh)
    return model


def _apply_ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    group = ctx.mesh["dp_replicate"].get_group()
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(model, process_group=group, device_ids=device_ids, gradient_as_bucket_view=True)


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip gradient communication on accumulation micro-batches; sync on the last one."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    else:
        yield


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under any DDP wrapper (FSDP2 keeps the module itself)."""
    return model.module if isinstance(model, DDP) else model


def dp_loss_scale(ctx: DistContext) -> float:
    """Factor that turns the data-parallel gradient *mean* back into a *sum*.

    FSDP and DDP divide reduced gradients by the dp degree; our loss is already normalised by the
    step's global token count, so we pre-multiply by the degree (exact for powers of two).
    """
    return float(ctx.dims.dp)


def local_model_bytes(model: nn.Module) -> int:
    """Bytes of parameters this rank holds (a shard under FSDP)."""
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def as_full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
