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
Only the thread that installed the tap (the training loop) is counted per step and recorded;
calls from other threads — the background checkpoint writer — go to `CommTap.background`.

Bytes are the size of the buffer the collective works on, the convention of nccl-tests' "size":
all-reduce, broadcast, send/recv: the tensor; all-gather: the gathered output; reduce-scatter and
all-to-all: the full input. Time is from the call to completion: the return of a synchronous call,
or the completion callback of an asynchronous one (functional collectives: the call only, as
their completion is not observable without waiting on them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

#: (module attribute name, op label, tensor-bytes extractor, position of the `group` argument)
_Extract = Callable[[tuple, dict], int]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


def _first(name: str = "tensor") -> _Extract:
    return lambda a, k: _nbytes(_arg(a, k, 0, name))


def _second(name: str) -> _Extract:
    return lambda a, k: _nbytes(_arg(a, k, 1, name))


def _list_sum(i: int, name: str) -> _Extract:
    return lambda a, k: sum(_nbytes(t) for t in (_arg(a, k, i, name) or ()))


def _gathered(a: tuple, k: dict) -> int:  # all_gather(tensor_list, tensor): the gathered output
    return sum(_nbytes(t) for t in (_arg(a, k, 0, "tensor_list") or ()))


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
    "barrier": ("barrier", lambda a, k: 0, 0),
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


def wire_factor(op: str, n: int) -> float:
    """Bytes sent per buffer byte by a bandwidth-optimal ring of n ranks (the volume model the
    theoretical minima use): all-reduce 2(n-1)/n, all-gather / reduce-scatter / all-to-all /
    broadcast (n-1)/n, send 1, recv 0."""
    if n <= 1:
        return 0.0 if op not in ("send", "p2p") else 1.0
    return {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0, "p2p": 1.0,
            "barrier": 0.0}.get(op, (n - 1) / n)


@dataclass
class StepComm:
    """One step's communication on this rank: totals by "op:axis", and the wall time during which
    at least one collective was in flight (its complement in the step is compute)."""

    by_op: dict[str, OpTotals] = field(default_factory=dict)
    inflight_s: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.by_op.values())

    @property
    def wire_bytes(self) -> float:
        return sum(t.wire_bytes for t in self.by_op.values())

    @property
    def time_s(self) -> float:
        return sum(t.time_s for t in self.by_op.values())


class CommTap:
    """Counts collectives while installed; at most one is installed per process.

    `axes` maps process-group names to mesh-axis names ("dp_shard", "tp", "pp", "dp", "world");
    `recorder` (optional) receives every call for hang diagnosis; `on_span` (optional) receives
    (op, axis, bytes, t_start, t_end) of completed calls for the timeline trace.
    """

    def __init__(self, axes: dict[str, str], recorder: Any = None) -> None:
        self.axes = dict(axes)
        self.recorder = recorder
        self.on_span: Callable[[str, str, int, float, float], None] | None = None
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._step: StepComm = StepComm()
        self._intervals: list[list[float]] = []  # [start, end or inf] of this step's calls
        self.totals: dict[str, OpTotals] = {}  # the whole run
        # Calls from other threads (the background checkpoint writer's collectives, on its own
        # group): counted here only — not in the training step, not as watchdog progress.
        self.background: dict[str, OpTotals] = {}
        self._owner = threading.get_ident()
        self._sizes: dict[str, int] = {}
        self.step = 0

    # --- step boundaries (called by the trainer) --------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        with self._lock:
            self._step = StepComm()
            self._intervals = []

    def end_step(self) -> StepComm:
        """This step's totals; collectives still in flight count up to now."""
        now = time.perf_counter()
        with self._lock:
            result = self._step
            result.inflight_s = _union_length(self._intervals, now)
            self._step = StepComm()
            self._intervals = []
        return result

    # --- install / uninstall -------------------------------------------------------------------
    def install(self) -> CommTap:
        global _ACTIVE
        if _ACTIVE is not None:
            _ACTIVE.uninstall()
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        # One wrapper per function, set on every module that exports it: torch compares them
        # by identity (`P2POp` accepts only `isend` / `irecv`).
        for name, (op, extract, gpos) in C10D.items():
            self._wrap((c10d, dist), name, op, extract, gpos, gathered_by_size=False)
        for name, (op, extract, gpos, by_size) in FUNCOL.items():
            self._wrap((funcol,), name, op, extract, gpos, gathered_by_size=by_size)
        self._wrap_batch_p2p((c10d, dist))
        _ACTIVE = self
        return self

    def uninstall(self) -> None:
        global _ACTIVE
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
        if _ACTIVE is self:
            _ACTIVE = None

    def _set(self, modules: tuple[Any, ...], name: str, original: Any, wrapper: Any) -> None:
        for module in modules:
            if getattr(module, name, None) is original:
                self._saved.append((module, name, original))
                setattr(module, name, wrapper)

    def _wrap(self, modules: tuple[Any, ...], name: str, op: str, extract: _Extract, gpos: int,
              gathered_by_size: bool) -> None:
        original = getattr(modules[0], name, None)
        if original is None or getattr(original, "__shardwise_tap__", False):
            return
        tap = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(tap._local, "depth", 0):
                return original(*args, **kwargs)  # a collective inside a counted one
            group = _arg(args, kwargs, gpos, "group")
            return tap._call(original, args, kwargs, op, group, extract(args, kwargs),
                             gathered=gathered_by_size)

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
                             wire=sent)

        batch_isend_irecv.__shardwise_tap__ = True  # type: ignore[attr-defined]
        batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
        self._set(modules, "batch_isend_irecv", original, batch_isend_irecv)

    # --- one call ------------------------------------------------------------------------------
    def _call(self, original: Callable, args: tuple, kwargs: dict, op: str, group: Any,
              nbytes: int, wire: float | None = None, gathered: bool = False) -> Any:
        """`gathered`: `nbytes` is one rank's input of an all-gather whose output is counted."""
        name = _group_name(group)
        axis = self.axes.get(name, name)
        size = self._sizes.get(name)
        if size is None:
            size = self._sizes[name] = _group_size(group)
        if gathered:
            nbytes *= size
        if threading.get_ident() != self._owner:
            return self._background_call(original, args, kwargs, f"{op}:{axis}", nbytes)
        if wire is None:
            wire = nbytes * wire_factor(op, size)
        label = f"{axis} (group {name})" if axis != name else f"group {name}"
        slot = self.recorder.issue(op, label, nbytes, self.step) if self.recorder else None
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


_ACTIVE: CommTap | None = None


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
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
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
