"""The comm tap: every collective and point-to-point call of a run, counted by op, mesh axis,
bytes and time, per step and for the run.

`CommTap.install()` sets the wrappers of `wrappers.py` on torch's collectives; each hands its call
to `CommTap._call`, which checks the tensor's device against the group's backend (`backends.py`),
counts the bytes (`calls.py`) under the group's mesh axis (`groups.py`), times the call
(`timing.py`) and adds it to the step's and the run's tallies (`totals.py`).

What a call costs here: two clock reads, a few dict updates and, when a flight recorder is
attached, one fixed-size record written into a memory-mapped file (see
`shardwise.resilience.flight`), so every rank's last collectives survive a crash or a hang.
Calls of the training loop's thread — and of autograd's worker threads while they run its
backward (on CUDA, backward hooks such as FSDP's reduce-scatter or DDP's hook run there) — are
counted per step and recorded; calls from other threads (the background checkpoint writer) go
to `CommTap.background`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.compat import TorchPatches, in_autograd_thread
from shardwise.telemetry.comm.backends import _device_error, _device_type, _served_by
from shardwise.telemetry.comm.calls import _storage_key, _works
from shardwise.telemetry.comm.groups import _group_name, _group_size
from shardwise.telemetry.comm.timing import DeviceClock, _DeviceCall, cuda_clock_for
from shardwise.telemetry.comm.totals import OpTotals, StepComm, _union_length
from shardwise.telemetry.comm.wrappers import wrap_torch
from shardwise.telemetry.comm_theory import ring_fraction

#: unresolved device-timed calls above which the end of a step waits for the oldest to resolve
MAX_PENDING = 4096


def _in_backward() -> bool:
    """True on a thread that is running an autograd graph task (on CUDA: the engine's device
    threads, which run backward hooks and so issue FSDP's and DDP's gradient collectives)."""
    return in_autograd_thread()


class CommTap:
    """Counts collectives while installed; at most one is installed per process.

    `axes` maps process-group names to mesh-axis names ("dp_shard", "tp", "pp", "dp", "world");
    `recorder` (optional) receives every call for hang diagnosis; `on_span` (optional) receives
    (op, axis, bytes, t_start, t_end) of completed calls for the timeline trace. Seams for tests:
    `clock_for(tensor)` gives the device clock that times a call (None: host clock; default: CUDA
    events for CUDA tensors), `served_by(group)` the device types a group's backend takes.
    """

    def __init__(self, axes: dict[str, str], recorder: Any = None,
                 clock_for: Callable[[torch.Tensor], DeviceClock | None] = cuda_clock_for,
                 served_by: Callable[[Any], frozenset[str] | None] = _served_by) -> None:
        self.axes = dict(axes)
        self.recorder = recorder
        self.on_span: Callable[[str, str, int, float, float], None] | None = None
        self._clock_for = clock_for
        self._timed_cpu = clock_for is not cuda_clock_for  # a test clock may time CPU tensors
        self._served_by = served_by
        self._patches: TorchPatches | None = None  # while installed
        self._mark = 0
        self._local = threading.local()
        self._lock = threading.Lock()
        self._resolving = threading.Lock()  # one thread at a time turns events into figures
        self._step: StepComm = StepComm()
        self._intervals: list[list[float]] = []  # [start, end or inf] of this step's host calls
        self._pending: list[_DeviceCall] = []  # device-timed calls not yet resolved
        self._awaiting: dict[int, _DeviceCall] = {}  # functional results by storage, until waited
        self.totals: dict[str, OpTotals] = {}  # the whole run
        # Calls from other threads (the background checkpoint writer's collectives, on its own
        # group): counted here only — not in the training step, not as watchdog progress.
        self.background: dict[str, OpTotals] = {}
        self._owner = threading.get_ident()
        # group name -> (size, device types its backend serves, flight-record label): once per group
        self._groups: dict[str, tuple[int, frozenset[str] | None, str]] = {}
        self.step = 0

    # --- step boundaries (called by the trainer) --------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        with self._lock:
            self._step = StepComm()
            self._intervals = []

    def end_step(self) -> StepComm:
        """This step's totals; host-timed collectives still in flight count up to now, device-timed
        ones resolve now if their events have completed, later otherwise (see `poll`)."""
        if self._awaiting:
            self._time_unwaited_on_host()
        left = self.poll()
        now = time.perf_counter()
        with self._lock:
            result = self._step
            result.host_inflight_s = _union_length(self._intervals, now)
            self._step = StepComm()
            self._intervals = []
        if left > MAX_PENDING:  # the device is far behind: let it catch up (bounded)
            self.poll(wait_s=30.0, until=MAX_PENDING // 2)
        return result

    def poll(self, wait_s: float = 0.0, block: bool = True, until: int = 0) -> int:
        """Resolve the device-timed calls whose events have completed; returns how many are still
        pending. Never synchronises with the device: `wait_s` > 0 polls again until that much time
        has passed or at most `until` are left. `block=False` (the watchdog's thread) skips the
        round when another thread is resolving."""
        if not self._pending:
            return 0
        if not self._resolving.acquire(blocking=block):
            return len(self._pending)
        try:
            deadline = time.perf_counter() + wait_s
            while True:
                left = self._resolve_ready()
                if left <= until or time.perf_counter() >= deadline:
                    return left
                time.sleep(0.001)
        finally:
            self._resolving.release()

    def _resolve_ready(self) -> int:
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return 0
        with pending[0].clock.guard():
            ready = [call for call in pending if call.ready()]
            if ready:
                done = set(ready)
                with self._lock:
                    self._pending = [c for c in self._pending if c not in done]
                for call in ready:
                    self._finish(call)
        return len(pending) - len(ready)

    # --- install / uninstall -------------------------------------------------------------------
    def install(self, patches: TorchPatches | None = None) -> CommTap:
        """Wrap torch's collectives through `patches` (the worker's runtime; without one the tap
        keeps its own), undone by `uninstall` or, at the latest, when the runtime ends."""
        if getattr(dist.all_reduce, "__shardwise_tap__", False):
            raise RuntimeError("a CommTap is already installed in this process; uninstall it "
                               "before installing another")
        self._patches = patches if patches is not None else TorchPatches()
        self._mark = len(self._patches)
        wrap_torch(self, self._patches)
        return self

    def uninstall(self) -> None:
        if self._patches is not None:
            self._patches.undo_since(self._mark)
            self._patches = None

    # --- one call ------------------------------------------------------------------------------
    def _call(self, original: Callable, args: tuple, kwargs: dict, op: str, group: Any,
              nbytes: int, tensor: torch.Tensor | None, wire: float | None = None,
              gathered: bool = False, functional: bool = False) -> Any:
        """`gathered`: `nbytes` is one rank's input of an all-gather whose output is counted."""
        name = _group_name(group)
        axis = self.axes.get(name, name)
        known = self._groups.get(name)
        if known is None:
            known = self._groups[name] = (_group_size(group), self._served_by(group),
                                          f"{axis} (group {name})" if axis != name else f"group {name}")
        size, served, label = known
        if served is not None and tensor is not None and not (tensor.is_cpu and "cpu" in served) \
                and _device_type(tensor) not in served:
            raise _device_error(op, label, tensor, served)
        if gathered:
            nbytes *= size
        if threading.get_ident() != self._owner and not _in_backward():
            return self._background_call(original, args, kwargs, f"{op}:{axis}", nbytes)
        if wire is None:
            wire = nbytes * ring_fraction(op, size)
        slot = self.recorder.issue(op, label, nbytes, self.step) if self.recorder else None
        clock = self._clock_for(tensor) if tensor is not None and (self._timed_cpu or tensor.is_cuda) \
            else None
        if clock is not None:
            return self._device_call(clock, original, args, kwargs, op, axis, nbytes, wire, slot,
                                     functional)
        t0 = time.perf_counter()
        interval = [t0, float("inf")]
        with self._lock:
            self._intervals.append(interval)
            step_comm = self._step
        self._local.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            self._local.depth = 0
        works = _works(result)
        if works is None:  # synchronous: done on return
            self._done(op, axis, nbytes, wire, t0, time.perf_counter(), interval, step_comm, slot)
            return result
        pending = [len(works)]

        def finished(_: Any) -> None:
            with self._lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self._done(op, axis, nbytes, wire, t0, time.perf_counter(), interval, step_comm,
                           slot)

        for work in works:
            try:
                work.get_future().add_done_callback(finished)
            except (RuntimeError, AttributeError):  # a Work without a future: count the call
                finished(None)
        return result

    def _device_call(self, clock: DeviceClock, original: Callable, args: tuple, kwargs: dict,
                     op: str, axis: str, nbytes: int, wire: float, slot: int | None,
                     functional: bool) -> Any:
        """Time a call with device events: one before it on the current stream, the end one
        where its completion becomes visible (see `timing.py`)."""
        start, t_host = clock.mark(), time.perf_counter()
        with self._lock:
            step_comm = self._step
            call = _DeviceCall(op, axis, nbytes, wire, clock, step_comm, slot, t_host, start)
            if step_comm.anchor is None:
                step_comm.anchor, step_comm.anchor_t = call.start, call.t_host
            step_comm.unresolved += 1
            self._pending.append(call)
        self._local.depth = 1
        try:
            result = original(*args, **kwargs)
        except BaseException:
            self._abandon(call)  # the collective never started: nothing will complete
            raise
        finally:
            self._local.depth = 0
        call.t_return = time.perf_counter()
        if functional:
            self._await_functional(call, result)
            return result
        works = _works(result)
        if works is None:  # synchronous: the current stream now waits for the collective
            call.ends.append(clock.mark())
            return result
        call.expected = len(works)

        def finished(_: Any) -> None:  # on a stream that waits for the collective (NCCL)
            call.ends.append(clock.mark())

        for work in works:
            try:
                work.get_future().add_done_callback(finished)
            except (RuntimeError, AttributeError):  # a Work without a future: time its enqueue
                finished(None)
        return result

    def _await_functional(self, call: _DeviceCall, result: Any) -> None:
        outputs = result if isinstance(result, list | tuple) else [result]
        call.expected = len(outputs)
        for out in outputs:
            elem = getattr(out, "elem", None)
            if isinstance(elem, torch.Tensor) and not getattr(out, "completed", True):
                self._awaiting[_storage_key(elem)] = call
            else:  # already waited (under tracing) or not an async result
                call.ends.append(call.clock.mark())

    def _time_unwaited_on_host(self) -> None:
        """Functional results this step never waited through `funcol.wait_tensor` (a caller that
        used the op directly) have no device end: such calls keep the host time of the call."""
        calls = {id(c): c for c in self._awaiting.values()}.values()
        self._awaiting.clear()
        for call in calls:
            self._abandon(call)
            interval = [call.t_host, call.t_return]
            with self._lock:
                self._intervals.append(interval)
            self._done(call.op, call.axis, call.nbytes, call.wire, call.t_host, call.t_return,
                       interval, call.step_comm, call.slot)

    def _abandon(self, call: _DeviceCall) -> None:
        with self._lock:
            if call in self._pending:
                self._pending.remove(call)
                call.step_comm.unresolved -= 1

    def _finish(self, call: _DeviceCall) -> None:
        """A device-timed call's events have completed: its figures, its flight record, its span."""
        step_comm = call.step_comm
        try:
            start, end = call.seconds()
        except RuntimeError:  # events that cannot be compared (another device): count, untimed
            start = end = None
        with self._lock:
            step_comm.unresolved -= 1
            if start is not None:
                step_comm.device_intervals.append((start, end))
            seconds = max(0.0, end - start) if start is not None else 0.0
            key = f"{call.op}:{call.axis}"
            for table in (step_comm.by_op, self.totals):
                table.setdefault(key, OpTotals()).add(1, call.nbytes, call.wire, seconds)
        if call.slot is not None:
            self.recorder.complete(call.slot)
        if self.on_span is not None and start is not None:
            self.on_span(call.op, call.axis, call.nbytes, step_comm.anchor_t + start,
                         step_comm.anchor_t + end)

    def _background_call(self, original: Callable, args: tuple, kwargs: dict, key: str,
                         nbytes: int) -> Any:
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        with self._lock:  # the call's time (an async one: until issued)
            self.background.setdefault(key, OpTotals()).add(1, nbytes, 0.0,
                                                            time.perf_counter() - t0)
        return result

    def _done(self, op: str, axis: str, nbytes: int, wire: float, t0: float, t1: float,
              interval: list[float], step_comm: StepComm, slot: Any) -> None:
        key = f"{op}:{axis}"
        with self._lock:
            interval[1] = t1
            for table in (step_comm.by_op, self.totals):
                table.setdefault(key, OpTotals()).add(1, nbytes, wire, t1 - t0)
        if slot is not None:
            self.recorder.complete(slot)
        if self.on_span is not None:
            self.on_span(op, axis, nbytes, t0, t1)
