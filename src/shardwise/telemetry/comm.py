"""Every collective and point-to-point call of a run, counted by op, mesh axis, bytes and time.

How it sees the calls: `CommTap.install()` wraps the public functions of `torch.distributed` and of
`torch.distributed._functional_collectives` (which DTensor uses) for the life of the run. Each
wrapper records the call and forwards its arguments unchanged; nothing in the caller's code is
patched. Torch's own users of those functions — FSDP2, DTensor/TP, pipelining, DCP — are counted
the same way as shardwise's. DDP's reducer calls the process group from C++, so DDP is given a
comm hook (`ddp_comm_hook`) that issues its bucket all-reduce through the wrapped `all_reduce` (a
sum: shardwise normalises the loss by the global token count, so nothing is divided by the ranks).

What a call costs here: two clock reads, a few dict updates and, when a flight recorder is
attached, one fixed-size record written into a memory-mapped file (see
`shardwise.resilience.flight`), so every rank's last collectives survive a crash or a hang.
Calls of the training loop's thread — and of autograd's worker threads while they run its
backward (on CUDA, backward hooks such as FSDP's reduce-scatter or DDP's hook run there) — are
counted per step and recorded; calls from other threads (the background checkpoint writer) go
to `CommTap.background`.

Before forwarding, the tap checks that the group's backend serves the tensor's device (a CPU
tensor on an NCCL group, a CUDA tensor on a gloo group) and raises `BackendDeviceError` naming
the op, the axis and the fix; the backend of each group is looked up once.

Bytes are the size of the buffer the collective works on, the convention of nccl-tests' "size":
all-reduce, broadcast, send/recv: the tensor; all-gather: the gathered output; reduce-scatter and
all-to-all: the full input.

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
  than `MAX_PENDING` unresolved calls) waits for them, and only for a bounded time.

The in-flight time of a step — its complement is compute time, which the straggler detector
compares — is the union of its calls' intervals: host intervals for host-timed calls, device
intervals (relative to the step's first device event) for device-timed ones.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardwise.compat import (
    TorchPatches,
    functional_collectives,
    in_autograd_thread,
    resolve_process_group,
)
from shardwise.telemetry.comm_theory import ring_fraction

#: (bytes, the tensor whose device the call runs on) of a call, from its arguments
_Extract = Callable[[tuple, dict], tuple[int, torch.Tensor | None]]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


def _one(t: Any) -> tuple[int, torch.Tensor | None]:
    return (t.numel() * t.element_size(), t) if isinstance(t, torch.Tensor) else (0, None)


def _many(ts: Any) -> tuple[int, torch.Tensor | None]:
    ts = ts or ()
    return sum(_nbytes(t) for t in ts), next((t for t in ts if isinstance(t, torch.Tensor)), None)


def _first(name: str = "tensor") -> _Extract:
    return lambda a, k: _one(_arg(a, k, 0, name))


def _second(name: str) -> _Extract:
    return lambda a, k: _one(_arg(a, k, 1, name))


def _list_sum(i: int, name: str) -> _Extract:
    return lambda a, k: _many(_arg(a, k, i, name))


def _gathered(a: tuple, k: dict) -> tuple[int, torch.Tensor | None]:
    return _many(_arg(a, k, 0, "tensor_list"))  # all_gather(tensor_list, tensor): the output


#: torch.distributed functions: name -> (op label, bytes, group position)
C10D: dict[str, tuple[str, _Extract, int]] = {
    "all_reduce": ("all_reduce", _first(), 2),
    "broadcast": ("broadcast", _first(), 2),
    "reduce": ("reduce", _first(), 3),
    "all_gather_into_tensor": ("all_gather", _first("output_tensor"), 2),
    "all_gather_single": ("all_gather", _first("output_tensor"), 2),
    "_all_gather_base": ("all_gather", _first("output_tensor"), 2),
    "all_gather": ("all_gather", _gathered, 2),
    "reduce_scatter_tensor": ("reduce_scatter", _second("input"), 3),
    "reduce_scatter_single": ("reduce_scatter", _second("input"), 3),
    "_reduce_scatter_base": ("reduce_scatter", _second("input"), 3),
    "reduce_scatter": ("reduce_scatter", _list_sum(1, "input_list"), 3),
    "all_to_all_single": ("all_to_all", _second("input"), 4),
    "all_to_all": ("all_to_all", _list_sum(1, "input_tensor_list"), 2),
    "gather": ("gather", _first(), 3),
    "scatter": ("scatter", _first(), 3),
    "send": ("send", _first(), 2),
    "recv": ("recv", _first(), 2),
    "isend": ("send", _first(), 2),
    "irecv": ("recv", _first(), 2),
    "barrier": ("barrier", lambda a, k: (0, None), 0),
}

#: functional collectives (DTensor): name -> (op label, bytes, group position, output multiplier)
FUNCOL: dict[str, tuple[str, _Extract, int, bool]] = {
    "all_reduce": ("all_reduce", _first("self"), 2, False),
    "all_reduce_coalesced": ("all_reduce", _list_sum(0, "self"), 2, False),
    "all_gather_tensor": ("all_gather", _first("self"), 2, True),
    "all_gather_single": ("all_gather", _first("self"), 2, True),
    "all_gather_tensor_autograd": ("all_gather", _first("self"), 2, True),
    "reduce_scatter_tensor": ("reduce_scatter", _first("self"), 3, False),
    "reduce_scatter_single": ("reduce_scatter", _first("self"), 3, False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", _first("self"), 3, False),
    "all_to_all_single": ("all_to_all", _first("self"), 3, False),
    "all_to_all_single_autograd": ("all_to_all", _first("self"), 3, False),
    "broadcast": ("broadcast", _first("self"), 2, False),
    "permute_tensor": ("send", _first("self"), 2, False),
}


@dataclass
class OpTotals:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0  # bytes this rank sends if the collective runs as a ring
    time_s: float = 0.0

    def add(self, calls: int, nbytes: int, wire: float, seconds: float) -> None:
        self.calls += calls
        self.bytes += nbytes
        self.wire_bytes += wire
        self.time_s += seconds


@dataclass
class StepComm:
    """One step's communication on this rank: totals by "op:axis", and the time during which at
    least one collective was in flight (its complement in the step is compute). Device-timed calls
    fill in when their events resolve, possibly after the step ended (`resolved` says when all
    have)."""

    by_op: dict[str, OpTotals] = field(default_factory=dict)
    host_inflight_s: float = 0.0  # union of the host-timed calls' intervals, set at the step's end
    device_intervals: list[tuple[float, float]] = field(default_factory=list)  # resolved, seconds
    unresolved: int = 0  # device-timed calls whose completion has not been seen yet
    anchor: Any = None  # the step's first device event: device intervals are relative to it
    anchor_t: float = 0.0  # host clock when the anchor was recorded (places spans on the trace)

    @property
    def inflight_s(self) -> float:
        return self.host_inflight_s + _union_length(list(self.device_intervals), float("inf"))

    @property
    def resolved(self) -> bool:
        return self.unresolved == 0

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.by_op.values())

    @property
    def wire_bytes(self) -> float:
        return sum(t.wire_bytes for t in self.by_op.values())

    @property
    def time_s(self) -> float:
        return sum(t.time_s for t in self.by_op.values())


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


#: unresolved device-timed calls above which the end of a step waits for the oldest to resolve
MAX_PENDING = 4096


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


class BackendDeviceError(RuntimeError):
    """A collective's tensor is on a device its process group's backend does not serve."""


#: device types each backend serves in a shardwise run. torch's gloo also takes a few CUDA
#: collectives by staging them through the host; on a run that has NCCL that is a bug, not a plan.
_SERVES: dict[str, frozenset[str]] = {"nccl": frozenset({"cuda"}), "gloo": frozenset({"cpu"})}


def devices_served(backend: str | None, device_types: Iterable[str] = ()) -> frozenset[str] | None:
    """The device types a group's backend takes; None when shardwise does not know (the `fake`
    and `threaded` test backends, MPI, UCC, plugins): those are never refused."""
    if not backend:
        return None
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        return frozenset(part.split(":", 1)[0].strip() for part in backend.split(","))
    if backend == "undefined":  # init_process_group() without a backend: one per device it has
        return frozenset(device_types) or None
    return _SERVES.get(backend)


def _served_by(group: Any) -> frozenset[str] | None:
    """What the group's backend serves (the default lookup; tests inject their own)."""
    try:
        pg = _resolve(group)
        backend = str(dist.get_backend(pg))
        types = [d.type for d in getattr(pg or dist.group.WORLD, "_device_types", ())]
    except Exception:  # a group this rank is not in, an exotic form: no check
        return None
    return devices_served(backend, types)


def _device_type(tensor: torch.Tensor) -> str:
    # the two common answers without building a torch.device (5x slower): this is per call
    return "cpu" if tensor.is_cpu else "cuda" if tensor.is_cuda else tensor.device.type


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
        funcol = functional_collectives()
        from torch.distributed import distributed_c10d as c10d

        # One wrapper per function, set on every module that exports it: torch compares them
        # by identity (`P2POp` accepts only `isend` / `irecv`).
        for name, (op, extract, gpos) in C10D.items():
            self._wrap((c10d, dist), name, op, extract, gpos, gathered_by_size=False)
        for name, (op, extract, gpos, by_size) in FUNCOL.items():
            self._wrap((funcol,), name, op, extract, gpos, gathered_by_size=by_size,
                       functional=True)
        self._wrap_batch_p2p((c10d, dist))
        self._wrap_wait_tensor(funcol)
        return self

    def uninstall(self) -> None:
        if self._patches is not None:
            self._patches.undo_since(self._mark)
            self._patches = None

    def _set(self, modules: tuple[Any, ...], name: str, original: Any, wrapper: Any) -> None:
        for module in modules:
            if getattr(module, name, None) is original:
                assert self._patches is not None  # set by install()
                self._patches.set(module, name, wrapper)

    def _wrap(self, modules: tuple[Any, ...], name: str, op: str, extract: _Extract, gpos: int,
              gathered_by_size: bool, functional: bool = False) -> None:
        original = getattr(modules[0], name, None)
        if original is None or getattr(original, "__shardwise_tap__", False):
            return
        tap = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(tap._local, "depth", 0):
                return original(*args, **kwargs)  # a collective inside a counted one
            nbytes, tensor = extract(args, kwargs)
            return tap._call(original, args, kwargs, op, _arg(args, kwargs, gpos, "group"), nbytes,
                             tensor, None, gathered_by_size, functional)

        wrapper.__shardwise_tap__ = True  # type: ignore[attr-defined]
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(original, "__name__", name)
        wrapper.__doc__ = original.__doc__
        self._set(modules, name, original, wrapper)

    def _wrap_batch_p2p(self, modules: tuple[Any, ...]) -> None:
        original = getattr(modules[0], "batch_isend_irecv", None)
        if original is None or getattr(original, "__shardwise_tap__", False):
            return
        tap = self

        def batch_isend_irecv(p2p_op_list: list) -> Any:
            if getattr(tap._local, "depth", 0) or not p2p_op_list:
                return original(p2p_op_list)
            nbytes = sum(_nbytes(p.tensor) for p in p2p_op_list)
            sent = sum(_nbytes(p.tensor) for p in p2p_op_list
                       if getattr(p.op, "__name__", "") in ("isend", "send"))
            return tap._call(original, (p2p_op_list,), {}, "p2p", p2p_op_list[0].group, nbytes,
                             p2p_op_list[0].tensor, wire=sent)

        batch_isend_irecv.__shardwise_tap__ = True  # type: ignore[attr-defined]
        batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
        self._set(modules, "batch_isend_irecv", original, batch_isend_irecv)

    def _wrap_wait_tensor(self, funcol: Any) -> None:
        """A functional collective completes, for its consumer's stream, at `wait_tensor`
        (AsyncCollectiveTensor calls it on first use): the end event of a device-timed one goes
        there."""
        original = getattr(funcol, "wait_tensor", None)
        if original is None or getattr(original, "__shardwise_tap__", False):
            return
        tap = self

        def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
            out = original(tensor)
            if tap._awaiting and isinstance(tensor, torch.Tensor):
                call = tap._awaiting.pop(_storage_key(tensor), None)
                if call is not None:
                    call.ends.append(call.clock.mark())
            return out

        wait_tensor.__shardwise_tap__ = True  # type: ignore[attr-defined]
        wait_tensor.__wrapped__ = original  # type: ignore[attr-defined]
        wait_tensor.__doc__ = original.__doc__
        self._set((funcol,), "wait_tensor", original, wait_tensor)

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
        where its completion becomes visible (see the module docstring)."""
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


def _device_error(op: str, where: str, tensor: torch.Tensor,
                  served: frozenset[str]) -> BackendDeviceError:
    return BackendDeviceError(
        f"{op} on {where} got a tensor on {tensor.device}, but the group's backend serves only "
        f"{', '.join(sorted(served))} tensors (a CPU tensor on an NCCL group fails at the first "
        "collective on a multi-GPU machine). Create the tensor on the run's device, ctx.device "
        "(e.g. torch.zeros(..., device=ctx.device)); for host-side data, use a gloo group instead.")


def _storage_key(tensor: torch.Tensor) -> int:
    """A functional result and the views of it that get waited share one storage."""
    return tensor.untyped_storage().data_ptr()



def ddp_comm_hook(group: dist.ProcessGroup | None) -> Callable:
    """DDP's all-reduce of each gradient bucket as a plain sum (shardwise divides the loss by the
    step's global token count, so no rank count is divided out), issued through
    `torch.distributed.all_reduce` so the tap sees the bytes DDP's C++ reducer sends."""

    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # DDP checks the annotations as objects; `from __future__ import annotations` made strings.
    hook.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def _is_work(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) and hasattr(x, "wait") and hasattr(x, "get_future")


def _works(result: Any) -> list | None:
    """The Work handles of an asynchronous call (None when the call was synchronous)."""
    if result is None or isinstance(result, torch.Tensor):  # the common cases, first
        return None
    if _is_work(result):
        return [result]
    if isinstance(result, list) and result and all(_is_work(w) for w in result):
        return result
    return None


def _union_length(intervals: Iterable[list[float]], now: float) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted((s, min(e, now)) for s, e in intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _resolve(group: Any) -> dist.ProcessGroup | None:
    """A process group from any of the forms torch accepts; None is the default group."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        return mesh.get_group(dim)
    if isinstance(group, str):
        return resolve_process_group(group)
    get_group = getattr(group, "get_group", None)  # a 1-D DeviceMesh
    if get_group is not None:
        return get_group()
    return None


def _group_name(group: Any) -> str:
    if isinstance(group, str):  # functional collectives name their group
        return group
    if isinstance(group, tuple) and len(group) == 2:  # (mesh, dim): DTensor's form, hot in TP
        key = (id(group[0]), group[1])
        cached = _MESH_GROUPS.get(key)
        if cached is None or cached[0] is not group[0]:
            cached = _MESH_GROUPS[key] = (group[0], _resolve(group).group_name)
        return cached[1]
    try:
        pg = _resolve(group)
        if pg is None:
            return "world" if not dist.is_initialized() else dist.group.WORLD.group_name
        return pg.group_name
    except Exception:  # an exotic form (a rank list): still count the call
        return "other"


#: (id(mesh), dim) -> (mesh, group name); holding the mesh keeps its id from being reused
_MESH_GROUPS: dict[tuple[int, Any], tuple[Any, str]] = {}


def _group_size(group: Any) -> int:
    try:
        pg = _resolve(group)
        return dist.get_world_size(pg)
    except Exception:
        return 1


def axes_of(mesh: Any, dp_mesh: Any) -> dict[str, str]:
    """Process-group name -> mesh axis name, for the named mesh of a run (None: one process)."""
    axes: dict[str, str] = {}
    if dist.is_initialized():
        axes[dist.group.WORLD.group_name] = "world"
    if dp_mesh is not None and dp_mesh.size() > 1:
        axes[dp_mesh.get_group().group_name] = "dp"
    for name in (mesh.mesh_dim_names or ()) if mesh is not None else ():
        group = mesh.get_group(name)
        if group.size() > 1:  # a real axis names its group, even when it spans the world
            axes[group.group_name] = name
        else:
            axes.setdefault(group.group_name, name)
    return axes
