"""Deterministic modes set what CUDA needs, checked without a GPU: the kernel switches through a
stand-in device (torch's switches are plain process flags), the cuBLAS workspace variable by the
function that must set it before CUDA starts."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise.parallel.distributed import CUBLAS_DETERMINISTIC, init_distributed, shutdown
from shardwise.parallel.precision import configure_kernels
from shardwise.spec.layout import ParallelSection


@pytest.fixture
def restored_flags():
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    torch.backends.cuda.enable_mem_efficient_sdp(saved[3])
    torch.set_float32_matmul_precision(saved[4])
    torch.backends.cudnn.allow_tf32 = saved[5]


@pytest.mark.parametrize("capability, tf32, precision", [((9, 0), True, "high"),
                                                         ((9, 0), False, "highest"),
                                                         ((7, 0), True, "highest")])
def test_strict_on_cuda_picks_deterministic_kernels_and_tf32_by_spec(
        monkeypatch, restored_flags, capability, tf32, precision):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: capability)
    configure_kernels("strict", tf32, torch.device("cuda", 0))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    if hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.get_float32_matmul_precision() == precision
    assert torch.backends.cudnn.allow_tf32 == (precision == "high")


def test_deterministic_init_sets_the_cublas_workspace_before_cuda(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    ctx = init_distributed(ParallelSection(nproc=1, device="cpu"), deterministic=True)
    try:
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC
        assert ctx.world_size == 1
    finally:
        shutdown()
