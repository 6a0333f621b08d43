"""Collectives shardwise issues itself, written so that no torch version warns about them.

- torch 2.13 deprecates `all_gather_into_tensor` in favour of `all_gather_single` (and warns on
  every call of the old name); torch 2.11 has only the old one: `all_gather_flat` picks.
- Gathering a DTensor sharded over two mesh axes (FSDP over TP: a strided shard of dim 0 on both)
  needs two all-gathers, and DTensor warns on every rank that it could not merge them ("flatten
  mesh dimensions"); for a strided shard that advice does not apply — the all-gathers cannot be
  merged — so `gather_full` (used only to export and verify, never while training) gathers without
  that one log line. Training never gathers a 2-D gradient: the norm is computed from local shards
  (`run.optim.global_grad_norm`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def all_gather_flat(output: torch.Tensor, local: torch.Tensor,
                    group: dist.ProcessGroup | None) -> None:
    """Every rank's `local` concatenated into `output` (numel = world x local.numel())."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local, group=group)


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The whole value of `t` on every rank (collective for a DTensor; `t` itself otherwise)."""
    if not isinstance(t, DTensor):
        return t
    with _quiet_redistribution():
        return t.full_tensor()


@contextlib.contextmanager
def _quiet_redistribution() -> Iterator[None]:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def reduce_scatter_flat(output: torch.Tensor, full: torch.Tensor,
                        group: dist.ProcessGroup | None, async_op: bool = False) -> Any:
    """Rank r's chunk r (along dim 0) of the sum over ranks of `full`, into `output` (with
    `async_op`, the work to wait for)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, full, group=group, async_op=async_op)
