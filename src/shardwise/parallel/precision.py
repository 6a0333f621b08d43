"""One mixed-precision policy, the same arithmetic on every layout.

`run.precision = "bf16"` (or `"fp16"`) means, for single process, DDP, ZeRO-1/2/3, HSDP, tensor and
pipeline parallel alike:
- master weights, gradients (accumulation and data-parallel reduction) and optimizer state in fp32;
- matrix multiplies and attention in the compute dtype: `torch.autocast` casts their inputs and
  weights, and they accumulate in fp32 internally (softmax included) before rounding the output;
- everything else in fp32: the residual stream (the embedding output is fp32 and each block adds
  its bf16 output to it), the norms (with fp32 weights), and the loss, computed on fp32 logits.

FSDP is the one layout that stores parameters differently, and only where it changes no number:
under bf16 it gathers the weights of `nn.Linear` modules already cast to bf16 (the cast autocast
would make anyway, at half the all-gather bytes) and every other parameter in fp32; under fp16 it
gathers everything in fp32 (see `shardwise.parallel.data_parallel.fsdp_policies` for why); it
never casts a module's inputs, and its units are cut so that its backward hooks re-associate no
gradient sum (`shardwise.parallel.data_parallel.matmul_modules`).

What still differs between layouts is the order of fp32 sums (gradient reduction, accumulation,
the gradient norm), and where tensor, context and expert parallel place a bf16 rounding: a
row-parallel matmul rounds each rank's partial output before the sum (TP), ring attention merges
fp32 blocks where SDPA rounds its output once (CP), an expert's weight gradient over several
ranks' tokens is rounded once instead of per micro-batch (EP).
`tests/distributed/test_precision_policy.py` states the tolerances and how they follow.
"""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype matmuls run in; None for fp32."""
    return _DTYPES.get(precision)


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward context of the policy: autocast to the compute dtype, or nothing for fp32."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def configure_kernels(determinism: str, tf32: bool, device: torch.device) -> None:
    """Process-wide kernel choices a run depends on, set once before its first step.

    - `strict`/`invariant`: deterministic algorithms everywhere; on CUDA, scaled-dot-product
      attention only through the backends whose backward is deterministic in that mode (flash and
      math; cuDNN's and the memory-efficient kernel's are not), and cuDNN without autotuning.
      cuBLAS also needs CUBLAS_WORKSPACE_CONFIG before CUDA starts, which
      `parallel.distributed.init_distributed` sets.
    - `run.tf32`: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer GPUs).
    """
    if determinism != "fast":
        torch.use_deterministic_algorithms(True)
    if device.type != "cuda":
        return
    if determinism != "fast":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    ampere = torch.cuda.get_device_capability(device) >= (8, 0)
    torch.set_float32_matmul_precision("high" if tf32 and ampere else "highest")
    torch.backends.cudnn.allow_tf32 = bool(tf32 and ampere)
