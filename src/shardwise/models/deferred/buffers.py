"""Host memory for the tensors a record names: a `Ref` viewed in a storage, scratch of its
geometry, and the one reused buffer (`_Pool`) that keeps the recording's and the replay's peak
memory at the largest tensor.
"""

from __future__ import annotations

import torch

from shardwise.models.deferred.record import Ref, _extent


def _view(storage: torch.UntypedStorage, ref: Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device="cpu").set_(storage, ref.offset, ref.size,
                                                              ref.stride)


def _scratch(ref: Ref) -> torch.Tensor:
    return _view(torch.UntypedStorage(_extent(ref), device="cpu"), ref)


class _Pool:
    """One reusable host buffer for the big short-lived tensors: the scratch of random ops while
    recording, each replayed parameter while materialising. Allocating and freeing one buffer
    per tensor, with the record's small long-lived allocations (generator states) landing in the
    freed holes, fragmented glibc's heap: 0.5-1.1 GB of peak RSS for a 0.66 GB model, varying
    run to run (measured, benchmarks/bench_init.py); with the pool the peak is the largest
    tensor."""

    def __init__(self) -> None:
        self._buffer: torch.UntypedStorage | None = None
        self._busy = False

    def take(self, nbytes: int) -> torch.UntypedStorage | None:
        """The buffer, at least `nbytes` long; None while it is taken."""
        if self._busy:
            return None
        if self._buffer is None or self._buffer.nbytes() < nbytes:
            self._buffer = None  # free the smaller one first
            self._buffer = torch.UntypedStorage(nbytes, device="cpu")
        self._busy = True
        return self._buffer

    def release(self) -> None:
        self._busy = False

