"""Which device a run computes on, how many local workers it starts, and which backend joins them.

One place decides, for the launcher (before any worker starts) and for every worker (under
torchrun, which starts the workers itself):
- device `auto` is `cuda` when a GPU is visible, else `cpu`; asking for `cuda` without one is a
  user error;
- `nproc = 0` is one worker per visible GPU on `cuda` and 2 on `cpu` (the embedded default);
- on `cuda`, more local workers than visible GPUs are refused: NCCL refuses two ranks on one GPU,
  and sharing one would only make every rank slower;
- backend `auto` is `nccl` on `cuda`, `gloo` on `cpu`. The spec refuses the two mismatches
  (gloo with cuda, nccl with cpu) on its own.
"""

from __future__ import annotations

import os

import torch
import torch.distributed

from shardwise.errors import SpecError
from shardwise.spec.layout import ParallelSection

#: local workers for nproc = 0 on a machine without a GPU
CPU_DEFAULT_WORKERS = 2


def cuda_count() -> int:
    """Visible CUDA devices (0 without CUDA, or when the driver cannot be initialised)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:
        return 0


def resolve_device_type(section: ParallelSection) -> str:
    if section.device == "auto":
        return "cuda" if cuda_count() > 0 else "cpu"
    if section.device == "cuda" and cuda_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise SpecError(
            "parallel.device = \"cuda\", but no CUDA device is visible to this process (torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES={visible!r}). "
            "Install a CUDA build of torch and check the driver, or set parallel.device = \"cpu\".")
    return section.device


def resolve_backend(section: ParallelSection, device_type: str) -> str:
    """The process-group backend, checked against the device the run resolved to (the spec
    refuses the mismatches it can see; with `device = "auto"` they show only here)."""
    backend = section.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise SpecError(
            "parallel.backend = \"nccl\", but this run computes on the CPU (no CUDA device is "
            "visible, or parallel.device = \"cpu\"): NCCL runs collectives on GPUs only. Use "
            "backend = \"gloo\" or \"auto\".")
    if backend == "gloo" and device_type == "cuda":
        raise SpecError(
            "parallel.backend = \"gloo\" on a CUDA run: gloo cannot run FSDP's and tensor "
            "parallel's collectives on CUDA tensors. Use backend = \"nccl\" or \"auto\" on GPUs, "
            "or parallel.device = \"cpu\" to train on the CPU.")
    if backend == "nccl" and not torch.distributed.is_nccl_available():
        raise SpecError(f"parallel.backend = \"nccl\", but this torch build ({torch.__version__}) "
                        "has no NCCL. Install a CUDA build of torch with NCCL.")
    return backend


def resolve_nproc(section: ParallelSection, device_type: str | None = None) -> int:
    """Local workers for `shardwise train`: `parallel.nproc`, or the automatic count for 0;
    checked against the visible GPUs on cuda."""
    device_type = device_type or resolve_device_type(section)
    if section.nproc == 0:
        return max(1, cuda_count()) if device_type == "cuda" else CPU_DEFAULT_WORKERS
    check_local_workers(section.nproc, device_type)
    return section.nproc


def check_local_workers(local_world: int, device_type: str) -> None:
    """Refuse more workers on this machine than it has GPUs (cuda only)."""
    gpus = cuda_count()
    if device_type == "cuda" and local_world > gpus:
        raise SpecError(
            f"{local_world} local workers on cuda, but this machine has {gpus} visible GPU"
            f"{'s' if gpus != 1 else ''}: NCCL refuses two ranks on one GPU. Start at most {gpus} "
            f"(--nproc {gpus}, or parallel.nproc = 0 for one per GPU), or set parallel.device = "
            "\"cpu\" to train on the CPU.")


def pick_device(device_type: str, local_rank: int) -> torch.device:
    """This worker's device: its own GPU (local rank = GPU index), or the CPU."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
