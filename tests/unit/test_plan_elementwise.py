"""The planner's eager elementwise bytes against a count of the built-in block's own ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.planner import kernels
from shardwise.planner.elementwise import eager_bytes, fused_bytes
from shardwise.planner.models import ModelDims
from shardwise.telemetry.traffic import forward_backward_bytes
from tests.support.blocks import probe_block

# (compute dtype's bytes q, residual bytes r) -> how the block is run: bf16 model (FSDP2's and
# torchtitan's bf16 parameters and activations), fp32 model under bf16 autocast (shardwise's
# policy, docs/precision.md), fp32
MODES = {(2, 2): (torch.bfloat16, False), (2, 4): (torch.float32, True),
         (4, 4): (torch.float32, False)}


def _counted(h: int, heads: int, kv: int, ffn: int, tokens: int, dtype: torch.dtype,
             autocast: bool) -> tuple[int, int]:
    block, cos, sin, x = probe_block(h, heads, kv, ffn, tokens, dtype)
    grad = torch.randn(1, tokens, h, dtype=dtype)

    def forward() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return block(x, cos, sin)

    return forward_backward_bytes(forward, grad)


@pytest.mark.parametrize("qr", sorted(MODES))
@pytest.mark.parametrize("shape", [(256, 4, 2, 768), (384, 6, 6, 1024), (512, 16, 4, 1536)])
def test_eager_bytes_are_what_the_built_in_block_moves(qr: tuple[int, int],
                                                      shape: tuple[int, int, int, int]) -> None:
    """Per token (the slope between 64 and 128 tokens, so the per-step weight casts drop out),
    forward and backward, within 2 % of a dispatch-mode count of every non-matmul op."""
    h, heads, kv, ffn = shape
    dtype, autocast = MODES[qr]
    f1, b1 = _counted(h, heads, kv, ffn, 64, dtype, autocast)
    f2, b2 = _counted(h, heads, kv, ffn, 128, dtype, autocast)
    dims = ModelDims("probe", layers=1, hidden=h, heads=heads, kv_heads=kv, ffn=ffn, vocab=64)
    fwd, bwd = eager_bytes(dims, "dense", 1, 1, False, *qr, False, ffn)
    assert fwd == pytest.approx((f2 - f1) / 64, rel=0.02)
    assert bwd == pytest.approx((b2 - b1) / 64, rel=0.02)


def test_eager_bytes_split_by_where_tensor_and_sequence_parallel_put_them() -> None:
    """Eager moves several times the fused minimum; tensor parallel divides the head and FFN
    terms, sequence parallel also the residual stream's, and the projections' shared inputs
    (the whole sequence on every rank) are divided by neither."""
    dims = ModelDims("llama-ish", layers=1, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                     vocab=1000)
    one = eager_bytes(dims, "dense", 1, 1, False, 2, 4, False, 14336)
    fused = fused_bytes(dims, "dense", 1, 1, False, 2, 4, False, 14336)
    assert one[0] > 3 * fused[0] and one[1] > 3 * fused[1]
    tp = 8
    plain = eager_bytes(dims, "dense", 1, tp, False, 2, 4, False, 14336 // tp)
    sp = eager_bytes(dims, "dense", 1, tp, True, 2, 4, False, 14336 // tp)
    # forward under autocast: norms and adds 2·28 + 2·10 = 76 per h, the five casts 5·6 = 30
    rep, whole = 76 * 4096, 30 * 4096
    assert plain[0] - sp[0] == pytest.approx(rep * (1 - 1 / tp))
    assert sp[0] > whole + rep / tp
    # a bf16 model has no casts: the shared inputs cost forward nothing
    bf16 = eager_bytes(dims, "dense", 1, tp, True, 2, 2, False, 14336 // tp)
    assert bf16[0] == pytest.approx(sp[0] - whole - (76 - 92) * 4096 / tp)


def test_the_block_times_its_elementwise_work_as_its_modules_run_it() -> None:
    """`eager` moves the block's memory-bound time from the fused count to the eager one; its
    GEMMs and attention are the same kernels either way."""
    chip = kernels.Chip(peak=1e15, gemm=0.8, attention=0.4, k_half=0.0, sms=0, hbm=2e12)
    dims = ModelDims("llama-ish", layers=1, hidden=1024, heads=8, kv_heads=2, ffn=4096,
                     vocab=1000)
    args = (dims, "dense", 2, 512, 1, 1, False, 2, 4, True, False, False, chip, 1)
    fused, eager = kernels.block_times(*args), kernels.block_times(*args, eager=True)
    f, b = eager_bytes(dims, "dense", 1024, 1, False, 2, 4, False, 4096)
    assert eager.forward.memory == pytest.approx(f / 2e12)
    assert eager.backward.memory == pytest.approx(b / 2e12)
    assert dataclasses.replace(eager.forward, memory=0) == \
        dataclasses.replace(fused.forward, memory=0)
