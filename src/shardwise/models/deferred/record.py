"""What a recorded meta-device build is: the vocabulary the recorder writes and the replayer reads.

A record (`InitRecord`) is a list of storages, each a list of events: the op that created it
(`_Event` with `out` set), then the in-place ops that wrote it; an op (`_Call`) names the tensors it
read as `Ref`s — a storage at a version, and the tensor's geometry in it — the CPU tensors it read
as `_Const`s and its explicit generators as `_Gen`s. The geometry helpers at the end read a `Ref`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class CannotDefer(Exception):
    """The build cannot be recorded faithfully; the message says why."""


@dataclass(frozen=True)
class Ref:
    """A tensor as an op saw it: a storage at a version, and the tensor's geometry in it."""

    storage: int
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Const:
    index: int  # into InitRecord.constants (a CPU tensor an op read, cloned when it was read)


@dataclass(frozen=True)
class _Gen:
    state: torch.Tensor  # an explicit generator's state before the op


@dataclass
class _Call:
    func: Any  # torch._ops.OpOverload
    args: Any
    kwargs: Any
    rng: torch.Tensor | None  # the default CPU generator's state before the op (random ops)
    writes: frozenset[int]  # storages the op mutates
    geometry_only: bool  # reads its tensor inputs' metadata only (*_like, new_*)


@dataclass
class _Event:
    call: _Call | None
    out: int = -1  # creation: index of the output among the op's flattened outputs
    geometry: tuple | None = None  # creation: (size, stride, offset) of that output
    poison: str = ""  # why this storage cannot be rebuilt


@dataclass
class _Storage:
    nbytes: int
    events: list[_Event] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)  # events that overwrite it all
    depth: int = 1


@dataclass
class InitRecord:
    """What the meta build did, to rebuild any of the model's tensors on a CPU; or, for a model
    built eagerly (`deferred` False), why (`fallback`, empty when eager was asked for)."""

    deferred: bool
    storages: list[_Storage] = field(default_factory=list)
    constants: list[torch.Tensor] = field(default_factory=list)
    finals: dict[str, Ref] = field(default_factory=dict)  # parameter / buffer FQN -> its value
    fallback: str = ""

    @classmethod
    def eager(cls, reason: str = "") -> InitRecord:
        return cls(deferred=False, fallback=reason)


def _numel(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _dense_prefix(ref: Ref) -> bool:
    """Contiguous (row-major) geometry."""
    expected = 1
    for size, stride in zip(reversed(ref.size), reversed(ref.stride), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _extent(ref: Ref) -> int:
    """Bytes of storage a tensor of this geometry reaches."""
    if _numel(ref.size) == 0:
        return ref.offset * ref.dtype.itemsize
    last = ref.offset + sum((s - 1) * st for s, st in zip(ref.size, ref.stride, strict=True))
    return (last + 1) * ref.dtype.itemsize

