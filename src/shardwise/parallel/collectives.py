"""Collectives whose names moved between the torch versions shardwise supports.

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single` (and warns on every call of the old names); torch 2.11
has only the old ones. One function per operation picks the name the running torch has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, local: torch.Tensor,
                    group: dist.ProcessGroup | None) -> None:
    """Every rank's `local` concatenated into `output` (numel = world x local.numel())."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor,
                        group: dist.ProcessGroup | None) -> None:
    """Rank r's chunk r (along dim 0) of the sum over ranks of `full`, into `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, full, group=group)
