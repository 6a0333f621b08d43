"""Tensor parallel (Megatron column/row split) and sequence parallel, with DTensor.

The model declares which modules are column-, row- or sequence-parallel (`GPT.sharding_plan`);
this module turns that declaration into DTensor styles on the `tp` mesh axis:
- colwise: weight split by output features; rowwise: by input features, output reduced;
- with sequence parallel, activations between blocks (norms, residual adds) are split along the
  sequence dimension, so a rowwise output is a reduce-scatter and a colwise input an all-gather;
- with loss parallel, the output projection keeps logits split along the vocabulary and the cross
  entropy is computed on the shards (no all-gather of the logits).
"""

from __future__ import annotations

import contextlib
import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool,
                          loss_parallel: bool) -> None:
    """Shard `model` (a GPT or a pipeline stage of one) in place over `tp_mesh`."""
    declared = model.sharding_plan()
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    for name, _module in model.named_modules():
        kind = next((k for pattern, k in declared.items() if fnmatch.fnmatchcase(name, pattern)),
                    None)
        style = _style(name, kind, seq, sequence_parallel, loss_parallel) if kind else None
        if style is not None:
            plan[name] = style
        # Blocks take sequence-sharded activations and all-gather them once at the block input
        # (the attention and feed-forward inputs), then split the heads / hidden units.
        if name.endswith(".attention"):
            plan[name] = PrepareModuleInput(input_layouts=(seq, None, None),
                                            desired_input_layouts=(Replicate(), None, None))
        elif name.endswith(".feed_forward"):
            plan[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    parallelize_module(model, tp_mesh, plan)


def _style(name: str, kind: str, seq, sequence_parallel: bool, loss_par: bool):
    if name == "tok_embeddings":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if name == "output":
        return ColwiseParallel(input_layouts=seq,
                               output_layouts=Shard(-1) if loss_par else Replicate(),
                               use_local_output=not loss_par)
    if kind == "sequence":
        return SequenceParallel() if sequence_parallel else None
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    raise ValueError(f"unknown sharding kind {kind!r} for {name}")


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross entropy on vocabulary-sharded logits (DTensor's loss_parallel) when enabled."""
    return loss_parallel() if enabled else contextlib.nullcontext()
