"""Gradient buckets whose reduction starts during backward (the reducers of `parallel.flat_dp`).

DDP starts each bucket's all-reduce inside backward; the optimizers that reduce for tensor- and
pipeline-parallel layouts (zero 0/1) did so only after the step's last backward. `ReadyBuckets`
gives them the same overlap without knowing the schedule: a post-accumulate-grad hook on every
parameter counts its gradient's arrivals; `arm(n)` before the step's backwards says how many
each parameter gets (one per micro-batch, whatever the pipeline schedule interleaves); once every
parameter of a bucket has its n-th, the bucket's collective starts (asynchronously) while
backward goes on with the layers before it.

Buckets start strictly in their given order, on every rank alike: collectives on one process
group must be issued in the same order on all its ranks, and which bucket is ready first could
differ between ranks (an expert no token chose on one rank gets no gradient there). A bucket that
is ready waits for the ones before it; `flush` after backward starts every bucket not started
yet, in order. What cannot start early therefore only loses its overlap: a bucket with a
parameter that got fewer arrivals, one whose gradient is still a partial sum (sequence-parallel
norms: the trainer sums those over the tensor-parallel ranks after backward), and buckets given
no parameters to watch (tied copies on several pipeline stages, summed after the schedule). A
parameter that receives a gradient after its bucket started marks the bucket stale: its owner
reduces it again. Under zero-bubble schedules torch's weight pass accumulates gradients outside
autograd's hooks, so there every bucket starts at `flush`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class Bucket:
    """One collective's worth of gradients. `watch`: the parameters whose last arrival makes it
    ready (empty: it never starts early); `launch`: start its collective."""

    watch: list[nn.Parameter]
    launch: Callable[[], None]
    started: bool = False
    stale: bool = False
    arrived: int = field(default=0, repr=False)  # watched parameters complete this step

    def settle(self, wait: Callable[[], None], launch_now: Callable[[], None]) -> None:
        """After backward, in its owner's `reduce`: the collective done on the final gradients
        (`launch_now` runs it synchronously: if it never started, or again if stale)."""
        if not self.started:
            self.started = True
            launch_now()
        wait()
        if self.stale:  # a gradient changed after the bucket started
            launch_now()
        self.started = self.stale = False


def plan_buckets(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Indices of `sizes` (elements, in the order backward produces them) grouped into buckets of
    at most `cap` elements (a larger item alone)."""
    buckets: list[list[int]] = []
    filled = cap
    for i, size in enumerate(sizes):
        if buckets and buckets[-1] and filled + size > cap:
            buckets.append([])
            filled = 0
        if not buckets:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


def cap_elements(bucket_mb: float, bytes_per_element: int = 4) -> int:
    return max(1, int(bucket_mb * 2**20 / bytes_per_element))


def _partial(grad: torch.Tensor | None) -> bool:
    return isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements)


class ReadyBuckets:
    """Starts `buckets` (in this order) during backward as they become ready, and the rest at
    `flush` (see the module docstring)."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = list(buckets)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.watch}
        self.handles = [p.register_post_accumulate_grad_hook(self._arrived)
                        for b in self.buckets for p in b.watch]
        self.expected = 0  # arrivals per parameter this step; 0: not armed (nothing early)
        self.arrivals: dict[int, int] = {}
        self.ready: set[int] = set()  # ids of buckets ready but not started
        self.next = 0  # the first bucket not started
        self.early = 0  # buckets this step started during backward (the rest at `flush`)

    def arm(self, arrivals: int) -> None:
        """Before the step's first backward: each watched parameter gets `arrivals` gradients."""
        self.expected = arrivals
        self.arrivals.clear()
        self.ready.clear()
        self.next = self.early = 0
        for b in self.buckets:
            b.started = b.stale = False
            b.arrived = 0

    def _arrived(self, p: torch.Tensor) -> None:
        bucket = self.bucket_of[id(p)]
        if not self.expected:
            return
        if bucket.started:
            bucket.stale = True
            return
        count = self.arrivals[id(p)] = self.arrivals.get(id(p), 0) + 1
        if count != self.expected:
            return
        bucket.arrived += 1
        if bucket.arrived == len(bucket.watch) and not any(_partial(q.grad)
                                                           for q in bucket.watch):
            self.ready.add(id(bucket))
            self._start_in_order(until_ready=True)

    def _start_in_order(self, until_ready: bool) -> None:
        while self.next < len(self.buckets):
            bucket = self.buckets[self.next]
            if until_ready and id(bucket) not in self.ready:
                return
            bucket.started = True
            bucket.launch()
            self.next += 1
            self.early += until_ready

    def flush(self) -> None:
        """After backward: start every bucket not started yet, in order; disarm."""
        self._start_in_order(until_ready=False)
        self.expected = 0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
