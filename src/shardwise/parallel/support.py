"""What the running torch supports: the version floor, and features a supported version lacks.

shardwise is tested on torch 2.11 (the GPU machines) and 2.13 (CPU CI); `pyproject.toml` declares
that range. Within it, one combination is known to fail and is refused with a message instead of a
gloo assertion deep inside the pipeline schedule:
- the zero-bubble (ZBV) schedule over gloo on torch < 2.13: its first step's shape exchange dies
  with "Pair is not connected" (measured on 2.11 CPU; 2.13 runs it and matches the single process).
"""

from __future__ import annotations

import re

import torch

from shardwise.errors import SpecError
from shardwise.spec.layout import ParallelSection

#: the lowest torch version shardwise is tested with (keep in step with pyproject.toml)
TORCH_FLOOR = (2, 11)


def torch_version(text: str | None = None) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", text or torch.__version__)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def check_torch_supports(par: ParallelSection, backend: str,
                         version: tuple[int, int] | None = None) -> None:
    """Raise SpecError when this torch cannot run the layout `par` asks for on `backend`."""
    have = version or torch_version()
    if have < TORCH_FLOOR:
        raise SpecError(
            f"shardwise needs torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}, but torch "
            f"{torch.__version__} is installed (pipeline schedules, FSDP2's custom reductions and "
            "DTensor APIs it relies on are missing or different before). Install a newer torch: "
            "pip install 'torch>=2.11,<2.14'.")
    if par.pp > 1 and par.pp_schedule == "zero-bubble" \
            and backend == "gloo" and have < (2, 13):
        raise SpecError(
            f"parallel.pp_schedule = \"zero-bubble\" over gloo fails on torch {torch.__version__} "
            "(its first step's point-to-point shape exchange aborts: \"Pair is not connected\"); "
            "torch 2.13 runs it. Use pp_schedule = \"interleaved-1f1b\" (pp_virtual_stages = 2) "
            "or \"1f1b\", or upgrade torch.")
