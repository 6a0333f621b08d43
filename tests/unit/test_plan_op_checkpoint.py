"""Per-op selective checkpointing ("op", torchtitan's policy) in the planner, against torch's own
selective checkpoint running the built-in block."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardwise.compat import TorchDispatchMode, tree_leaves
from shardwise.planner import kernels, op_checkpoint
from shardwise.planner.cluster import resolve_cluster
from shardwise.planner.cost import DEFAULT_PARAMS, predict
from shardwise.planner.layout import Batch, Layout, layout_problem
from shardwise.planner.models import ModelDims, preset
from tests.support.blocks import probe_block

# torchtitan's `_save_list`, with the CPU's flash attention kernel beside the CUDA ones
SAVE = {torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default}


class _Outputs(TorchDispatchMode):
    """Every op's output bytes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        size = sum(t.numel() * t.element_size() for t in tree_leaves(out)
                   if isinstance(t, torch.Tensor))
        self.ops.append((func, size))
        return out


def _saved_by_torch(h: int, heads: int, kv: int, ffn: int, tokens: int,
                    dtype: torch.dtype) -> float:
    """Bytes torch's selective checkpoint keeps for one forward of the built-in block under
    torchtitan's policy: the checkpoint's input and the outputs the policy saves (the recorder
    sees every op the policy is asked about, in the same order)."""
    block, cos, sin, x = probe_block(h, heads, kv, ffn, tokens, dtype)
    decisions: list[tuple[Any, bool]] = []

    def context() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                meta[key] += 1
            save = func in SAVE and not (func == torch.ops.aten.mm.default and meta[key] % 2 == 0)
            if not ctx.is_recompute:
                decisions.append((func, save))
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    recorder = _Outputs()
    with recorder:
        out = checkpoint(block, x, cos, sin, use_reentrant=False, context_fn=context)
    out.sum().backward()  # the recompute replays the saved outputs: it must run
    assert x.grad is not None and torch.isfinite(x.grad).all()
    ops = iter(recorder.ops)
    saved = 0
    for func, save in decisions:
        size = next(size for f, size in ops if f == func)
        saved += size if save else 0
    assert sum(func == torch.ops.aten.mm.default and s for func, s in decisions) == 4
    return saved + x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 4, 2, 160), (96, 6, 6, 256)])
def test_saved_bytes_are_what_torchs_selective_checkpoint_keeps(
        dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """The built-in block has torchtitan's projection order (q, k, v, o, w1, w3, w2): torch saves
    q, v, w1 and w2's outputs and the attention's output and log-sum-exp, and the planner's
    count is those bytes exactly, per token."""
    h, heads, kv, ffn = shape
    q = torch.finfo(dtype).bits // 8
    dims = ModelDims("probe", layers=1, hidden=h, heads=heads, kv_heads=kv, ffn=ffn, vocab=64)
    for tokens in (32, 64):
        counted = _saved_by_torch(h, heads, kv, ffn, tokens, dtype)
        assert op_checkpoint.saved_bytes(dims, tokens, 1, False, q, q) == counted
    # compiled, the partitioner drops w2's output: only the residual add reads it
    compiled = op_checkpoint.saved_bytes(dims, 64, 1, False, q, q, eager=False)
    assert op_checkpoint.saved_bytes(dims, 64, 1, False, q, q) - compiled == q * 64 * h


def test_tensor_and_sequence_parallel_split_what_they_shard() -> None:
    """Column-parallel outputs and the attention divide by tp; the row-parallel w2's output is the
    whole hidden width before its reduction; sequence parallel divides the checkpoint's input
    and adds the reduce-scatter outputs."""
    dims = ModelDims("llama-ish", layers=1, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                     vocab=1000)
    h, n = 4096, 1000
    one = op_checkpoint.saved_bytes(dims, n, 1, False, 2, 2)
    assert one == n * 2 * (h + h + 1024 + 14336 + h + h) + n * 4 * 32
    tp = op_checkpoint.saved_bytes(dims, n, 8, False, 2, 2)
    assert tp == n * 2 * (h + (h + 1024 + 14336 + h) / 8 + h) + n * 4 * 32 / 8
    sp = op_checkpoint.saved_bytes(dims, n, 8, True, 2, 2)
    assert sp == tp - n * 2 * h * 7 / 8 + 2 * n * 2 * h / 8


def test_the_recompute_is_three_projections_and_no_attention() -> None:
    """Llama 3.1 8B: k, o and w3 run again, 36.5 % of the forward's GEMM FLOPs; whole-block
    recompute also runs the attention again, per-op recompute saved it."""
    dims = ModelDims("llama31-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                     vocab=128256)
    forward = 2 * 4096 * (4096 + 2 * 1024 + 4096 + 3 * 14336)
    assert op_checkpoint.recompute_flops_per_token(dims) / forward == pytest.approx(0.365, abs=1e-3)
    chip = kernels.Chip(peak=1e15, gemm=0.8, attention=0.4, k_half=0.0, sms=0, hbm=2e12)
    bt = kernels.block_times(dims, "dense", 1, 8192, 1, 1, False, 2, 2, True, False, False, chip)
    assert bt.op_recompute.attention == 0 and bt.recompute.attention > 0
    assert bt.op_recompute.memory == bt.forward.memory
    assert bt.op_recompute.gemm == pytest.approx(19456 / 53248 * bt.forward.gemm, rel=1e-6)


def test_a_layout_with_per_op_recompute_is_predicted_and_refused_where_not_modelled() -> None:
    """Every block is checkpointed per op: less memory than none and than whole-block
    checkpointing under eager modules, more step time than none; MoE blocks are refused in
    words."""
    dense, moe = preset("llama3-8b"), preset("deepseek-v3")
    cluster = resolve_cluster("dgx-h100", nodes=2)
    batch = Batch(global_batch=32, seq_len=8192, precision="bf16")
    base = Layout(dp_shard=16, zero=3, micro_batch=2)
    params = dataclasses.replace(DEFAULT_PARAMS, eager_modules=True)
    pred = {rc: predict(dataclasses.replace(base, recompute=rc), dense, cluster, batch, params)
            for rc in ("none", "selective", "op")}
    assert pred["op"].memory.activations < pred["selective"].memory.activations \
        < pred["none"].memory.activations
    assert pred["none"].step_time_s < pred["op"].step_time_s
    assert layout_problem(dataclasses.replace(base, recompute="op"), dense, cluster, batch) is None
    problem = layout_problem(dataclasses.replace(base, recompute="op"), moe, cluster, batch)
    assert problem is not None and "MoE" in problem
