"""How a collective is timed: on the host clock, or by timing events on its device.

What "time" is depends on where the tensor lives:

- CPU tensors (gloo): host clock from the call to completion — the return of a synchronous call,
  or the completion callback of an asynchronous one (functional collectives: the call only, as
  their completion is not observable without waiting on them).
- CUDA tensors (NCCL): device time. A call returns once the kernel is enqueued, so host clocks
  would read ~0. A timing event is recorded on the caller's current stream before the call, and
  an end event where completion becomes visible: on the current stream after a synchronous call
  (which makes that stream wait for the collective); in the completion callback of each Work of
  an asynchronous call (torch runs it on a stream that waits for the NCCL stream); after the
  `wait_tensor` of a functional collective's result (one never waited through
  `funcol.wait_tensor` by the end of the step keeps the host time of its call). Time is the device
  time between the two events: from the caller's stream reaching the call until the collective is
  done, waiting for peers included. Events are read only once they have completed
  (`event.query()`, never a host synchronisation): at the end of each step, at log steps, and from
  the hang watchdog's thread; a step's figures fill in when its last event resolves, and the
  flight recorder marks a call completed then — not at enqueue. Only the end of the run (or more
  than `MAX_PENDING` unresolved calls, in `tap.py`) waits for them, and only for a bounded time.

This module has the clocks (`DeviceClock`: `CudaClock`, or a test's fake) and a device-timed call
until its events resolve (`_DeviceCall`); where the events are recorded is the tap's
(`CommTap._device_call`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardwise.telemetry.comm.totals import StepComm


class TimingEvent(Protocol):
    """What the tap needs of a device timing event (`torch.cuda.Event` has it; tests use fakes)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


class DeviceClock(Protocol):
    """Records timing events on the current stream of one device."""

    def mark(self) -> TimingEvent: ...

    def guard(self) -> contextlib.AbstractContextManager: ...


class CudaClock:
    """The real branch, kept thin: a timing event on the device's current stream."""

    def __init__(self, index: int) -> None:
        self.index = index

    def mark(self) -> TimingEvent:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.index))
        return event

    def guard(self) -> contextlib.AbstractContextManager:
        """A thread other than the one that made the events (the watchdog's) reads them on this
        device, so that it never creates a CUDA context on device 0."""
        return torch.cuda.device(self.index)


_CUDA_CLOCKS: dict[int, CudaClock] = {}


def cuda_clock_for(tensor: torch.Tensor) -> DeviceClock | None:
    """The device clock of a CUDA tensor; None (host timing) for every other device, and while a
    CUDA graph is being captured (a timing event cannot be recorded or queried there)."""
    if not tensor.is_cuda or torch.cuda.is_current_stream_capturing():
        return None
    index = tensor.get_device()
    clock = _CUDA_CLOCKS.get(index)
    if clock is None:
        clock = _CUDA_CLOCKS[index] = CudaClock(index)
    return clock


@dataclass(eq=False)
class _DeviceCall:
    """A device-timed call until its events resolve."""

    op: str
    axis: str
    nbytes: int
    wire: float
    clock: DeviceClock
    step_comm: StepComm
    slot: int | None
    t_host: float  # host clock at the call
    start: TimingEvent
    expected: int = 1  # end events to come: one per Work, or per functional output
    ends: list[TimingEvent] = field(default_factory=list)
    t_return: float = 0.0  # host clock when the call returned (functional calls' fallback)

    def ready(self) -> bool:
        return (len(self.ends) >= self.expected and all(e.query() for e in self.ends)
                and self.start.query() and self.step_comm.anchor.query())

    def seconds(self) -> tuple[float, float]:
        """(start, end) in device seconds after the step's anchor event."""
        anchor = self.step_comm.anchor
        return (anchor.elapsed_time(self.start) / 1e3,
                max(anchor.elapsed_time(e) for e in self.ends) / 1e3)
