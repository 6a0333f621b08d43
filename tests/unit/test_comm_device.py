"""Device timing, lazy completion and the backend/device guard of the comm tap, on CPU.

There is no GPU here: each test runs real gloo collectives on a world-1 process group and times
them through a fake device clock injected with `CommTap(clock_for=...)` — a scripted device
timeline whose events complete only when the test lets the "device" get that far. That is the
same path a CUDA tensor takes with `torch.cuda.Event`s; only `CudaClock` itself is not run.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from shardwise.resilience.flight import FlightRecorder, read_flight
from shardwise.resilience.watchdog import Watchdog
from shardwise.run.monitors import Monitors, StepSample
from shardwise.telemetry.comm.backends import BackendDeviceError, devices_served
from shardwise.telemetry.comm.tap import CommTap
from shardwise.telemetry.energy import EnergyMeter
from shardwise.telemetry.straggler import StragglerDetector


class FakeEvent:
    """A timing event at device time `t` (seconds); done once the device has run past it."""

    def __init__(self, t: float, clock: FakeClock) -> None:
        self.t, self.clock = t, clock

    def query(self) -> bool:
        return self.clock.done_until() >= self.t

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.query() and end.query()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.t - self.t) * 1e3


class FakeClock:
    """A device timeline scripted by the test: each mark takes the next device time of `times`;
    the device has executed up to `device_at` (or, with `speed`, as far as host time has gone)."""

    def __init__(self, times: list[float], speed: float = 0.0) -> None:
        self.times = list(times)
        self.device_at = -math.inf
        self.speed, self.t0 = speed, time.perf_counter()
        self.marks: list[FakeEvent] = []

    def done_until(self) -> float:
        if self.speed:
            return (time.perf_counter() - self.t0) * self.speed
        return self.device_at

    def mark(self) -> FakeEvent:
        event = FakeEvent(self.times.pop(0), self)
        self.marks.append(event)
        return event

    def guard(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


@pytest.fixture
def world1() -> Iterator[str]:
    """A world-1 gloo group in this process; yields its group name."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _tap(name: str, clock: FakeClock | None, recorder: FlightRecorder | None = None,
         **kwargs) -> CommTap:
    return CommTap({name: "dp"}, recorder, clock_for=lambda t: clock, **kwargs).install()


def _done_flags(recorder: FlightRecorder) -> list[bool]:
    flight = read_flight(recorder.path)
    assert flight is not None
    return [c.done for c in flight.calls]


def test_sync_call_takes_device_time_and_completes_only_when_the_device_does(world1, tmp_path):
    clock = FakeClock([10.0, 10.25])  # start event, end event (device seconds)
    recorder = FlightRecorder(tmp_path, 0, 1)
    tap = _tap(world1, clock, recorder)
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(8))  # returns at once, as an NCCL call does
        step = tap.end_step()
        # the device has not run the collective yet: nothing counted, the record still waiting
        assert not step.resolved and step.by_op == {} and step.inflight_s == 0
        assert _done_flags(recorder) == [False]
        clock.device_at = 10.1  # started, not finished
        assert tap.poll() == 1 and _done_flags(recorder) == [False]
        clock.device_at = 11.0
        assert tap.poll() == 0
    finally:
        tap.uninstall()
        recorder.close()
    assert step.resolved
    totals = step.by_op["all_reduce:dp"]
    assert (totals.calls, totals.bytes) == (1, 32)
    assert totals.time_s == pytest.approx(0.25)  # the device's time, not the host call's
    assert step.inflight_s == pytest.approx(0.25)
    assert tap.totals["all_reduce:dp"].time_s == pytest.approx(0.25)
    assert read_flight(recorder.path).calls[0].done


def _callbacks_ran(clock: FakeClock, marks: int) -> None:
    """gloo runs a Work's completion callbacks on its own thread: wait until they have marked."""
    deadline = time.perf_counter() + 10
    while len(clock.marks) < marks and time.perf_counter() < deadline:
        time.sleep(0.001)


def test_async_works_end_in_their_completion_callback(world1):
    clock = FakeClock([0.0, 0.1, 0.5, 0.8])  # a: start, a's callback; b: start, b's callback
    tap = _tap(world1, clock)
    spans: list[tuple[str, float, float]] = []
    tap.on_span = lambda op, axis, nbytes, t0, t1: spans.append((op, t0, t1))
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        _callbacks_ran(clock, 2)
        dist.broadcast(torch.ones(2), src=0, async_op=True).wait()
        _callbacks_ran(clock, 4)
        clock.device_at = 1.0
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.by_op["all_reduce:dp"].time_s == pytest.approx(0.1)
    assert step.by_op["broadcast:dp"].time_s == pytest.approx(0.3)
    assert step.inflight_s == pytest.approx(0.4)
    # trace spans keep the device timeline's shape, placed at the step's first call on the host
    assert [op for op, _, _ in spans] == ["all_reduce", "broadcast"]
    assert spans[1][1] - spans[0][1] == pytest.approx(0.5)
    assert spans[1][2] - spans[1][1] == pytest.approx(0.3)


def test_inflight_is_the_union_of_device_intervals(world1):
    # call 1 on [0, 0.2], call 2 on [0.1, 0.4] (overlapping, e.g. two streams), call 3 [1.0, 1.1]
    clock = FakeClock([0.0, 0.2, 0.1, 0.4, 1.0, 1.1])
    tap = _tap(world1, clock)
    try:
        tap.begin_step(1)
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        clock.device_at = 2.0
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.resolved
    assert step.time_s == pytest.approx(0.2 + 0.3 + 0.1)  # per-op times add up
    assert step.inflight_s == pytest.approx(0.4 + 0.1)  # overlap counted once


def test_cpu_tensors_keep_the_host_clock(world1):
    """The default clock is CUDA's: a CPU tensor is timed on the host, resolved at the call."""
    tap = CommTap({world1: "dp"}).install()
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(4))
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.resolved and step.device_intervals == [] and step.anchor is None
    assert step.by_op["all_reduce:dp"].calls == 1 and step.inflight_s > 0


def test_functional_collective_ends_at_its_wait(world1):
    clock = FakeClock([0.0, 0.3, 1.0])
    tap = _tap(world1, clock)
    try:
        tap.begin_step(1)
        out = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        assert len(clock.marks) == 1  # only the start: the call has not been waited on
        (out + 1).sum()  # first use waits (AsyncCollectiveTensor -> funcol.wait_tensor)
        assert len(clock.marks) == 2
        clock.device_at = 0.5
        step = tap.end_step()
        # a result never waited through funcol.wait_tensor keeps the host time of its call
        tap.begin_step(2)
        unwaited = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        host = tap.end_step()
        torch.ops._c10d_functional.wait_tensor(unwaited.elem)  # waited behind the tap's back
    finally:
        tap.uninstall()
    assert step.by_op["all_reduce:dp"].time_s == pytest.approx(0.3)
    assert host.resolved and host.by_op["all_reduce:dp"].calls == 1
    assert host.device_intervals == [] and 0 <= host.by_op["all_reduce:dp"].time_s < 1.0


def test_a_failed_call_is_not_left_pending(world1):
    clock = FakeClock([0.0])
    tap = _tap(world1, clock)
    try:
        tap.begin_step(1)
        with pytest.raises(RuntimeError, match="invalid root rank"):
            dist.broadcast(torch.ones(2), src=5)  # not a rank of the group: raised by gloo
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.resolved and tap.poll() == 0


def test_poll_waits_a_bounded_time_and_never_for_the_device(world1):
    clock = FakeClock([0.0, 1.0])
    tap = _tap(world1, clock)
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(4))
        tap.end_step()
        t0 = time.perf_counter()
        assert tap.poll(wait_s=0.1) == 1  # a collective that never completes: back after 0.1 s
        assert time.perf_counter() - t0 < 1.0
    finally:
        tap.uninstall()


def test_backward_on_another_thread_is_counted_in_the_step(world1):
    """On CUDA, autograd runs backward hooks on its device threads: their collectives (FSDP's
    reduce-scatter, DDP's hook) belong to the step, not to `background`."""
    tap = CommTap({world1: "dp"}).install()
    try:
        tap.begin_step(1)
        w = torch.ones(3, requires_grad=True)
        w.register_hook(lambda g: dist.all_reduce(g) or g)

        def backward() -> None:
            (w * 2).sum().backward()  # the hook runs inside this thread's graph task
            dist.all_reduce(torch.ones(5))  # outside backward: a background call

        worker = threading.Thread(target=backward)
        worker.start()
        worker.join()
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.by_op["all_reduce:dp"].bytes == 12
    assert list(tap.background) == ["all_reduce:dp"] and tap.background["all_reduce:dp"].bytes == 20


class _Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict]] = []

    def emit(self, kind: str, step: int, **fields: object) -> None:
        self.emitted.append((kind, fields))


def _monitors(tap: CommTap) -> Monitors:
    """The log-window part of Monitors, without a run around it."""
    m = object.__new__(Monitors)
    m.tap, m.window, m.events = tap, [], _Events()
    m.stragglers = StragglerDetector(1.5, 2)
    m.min_wire_bytes, m.current_straggler = None, ""
    m.energy, m._energy_said = EnergyMeter(), True  # no counters: the window reports none
    return m


def test_log_window_uses_device_inflight_and_carries_unresolved_steps(world1):
    clock = FakeClock([0.0, 0.2, 1.0, 1.3])  # step 1: [0, 0.2]; step 2: [1.0, 1.3]
    tap = _tap(world1, clock)
    monitors = _monitors(tap)
    gather = lambda values: [values]  # noqa: E731 - one rank
    try:
        for step, step_s in ((1, 0.5), (2, 0.4)):
            tap.begin_step(step)
            dist.all_reduce(torch.ones(4))
            clock.device_at = 0.5  # step 1 done on the device, step 2 not yet
            monitors.window.append(StepSample(step_s, 0.0, tap.end_step()))
        first = monitors.window_fields(2, gather)
        assert first["compute_s_per_rank"] == [pytest.approx(0.5 - 0.2)]
        assert first["comm_by_op"]["all_reduce:dp"]["time_s"] == pytest.approx(0.2)
        assert len(monitors.window) == 1  # step 2 waits for its device time
        clock.device_at = 2.0
        second = monitors.window_fields(3, gather)
    finally:
        tap.uninstall()
    assert second["compute_s_per_rank"] == [pytest.approx(0.4 - 0.3)]
    assert second["comm_time_s"] == pytest.approx(0.3) and monitors.window == []


def test_log_window_of_only_unresolved_steps_waits_then_reports(world1, monkeypatch):
    import shardwise.run.monitors as monitors_mod

    monkeypatch.setattr(monitors_mod, "LATE_WAIT_S", 0.05)
    clock = FakeClock([0.0, 1.0])
    tap = _tap(world1, clock)
    monitors = _monitors(tap)
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(4))
        monitors.window.append(StepSample(0.5, 0.0, tap.end_step()))
        fields = monitors.window_fields(1, lambda values: [values])
    finally:
        tap.uninstall()
    # every rank gathers every window: a window is never skipped for want of device times
    assert fields["step_time_s"] == 0.5 and monitors.window == []


def _watch(tmp_path: Path, poll: bool) -> bool:
    """A rank whose training thread sits in a long device wait while three collectives complete
    0.3 s apart on the device: does a 0.5 s watchdog call it a hang?"""
    clock = FakeClock([0.0, 0.3, 0.3, 0.6, 0.6, 0.9], speed=1.0)  # device time = host time
    recorder = FlightRecorder(tmp_path / ("poll" if poll else "no-poll"), 0, 1)
    tap = _tap(dist.group.WORLD.group_name, clock, recorder)
    fired: list[int] = []
    watchdog = Watchdog(recorder, 0.5, 1, exit=fired.append,
                        poll=(lambda: tap.poll(block=False)) if poll else None)
    try:
        tap.begin_step(1)
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        watchdog.start()
        time.sleep(1.0)  # the host waits (as on `loss.item()`) while the device works
        watchdog.stop()
    finally:
        tap.uninstall()
        recorder.close()
    return bool(fired)


def test_watchdog_sees_device_completions_as_progress(world1, tmp_path):
    assert not _watch(tmp_path, poll=True)
    assert _watch(tmp_path, poll=False)  # the same rank, completions not polled: a "hang"


def test_backend_device_guard(world1, tmp_path):
    asked: list[object] = []

    def nccl_only(group: object) -> frozenset[str]:
        asked.append(group)
        return frozenset({"cuda"})

    recorder = FlightRecorder(tmp_path, 0, 1)
    tap = CommTap({world1: "dp_shard"}, recorder, served_by=nccl_only).install()
    try:
        tap.begin_step(1)
        for _ in range(2):
            with pytest.raises(BackendDeviceError) as err:
                dist.all_reduce(torch.ones(4))
        with pytest.raises(BackendDeviceError):
            funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        step = tap.end_step()
    finally:
        tap.uninstall()
        recorder.close()
    text = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert "all_reduce on dp_shard (group 0)" in text and "tensor on cpu" in text
    assert "serves only cuda" in text and "ctx.device" in text
    assert len(asked) == 1  # the backend is looked up once per group
    assert step.by_op == {} and read_flight(recorder.path).calls == []  # nothing was forwarded


def test_real_backend_lookup_lets_cpu_tensors_through_gloo(world1):
    tap = CommTap({world1: "dp"}).install()
    try:
        tap.begin_step(1)
        dist.all_reduce(torch.ones(4))
        assert tap.end_step().by_op["all_reduce:dp"].calls == 1
    finally:
        tap.uninstall()
    assert tap._groups[world1][:2] == (1, frozenset({"cpu"}))


def test_devices_served_by_backend_name():
    assert devices_served("nccl") == {"cuda"}
    assert devices_served("gloo") == {"cpu"}
    assert devices_served("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert devices_served("undefined", ["cpu", "cuda"]) == {"cpu", "cuda"}
    assert devices_served("fake") is None and devices_served("threaded") is None
    assert devices_served(None) is None


def test_many_pending_timings_make_the_step_end_wait_for_the_device(world1, monkeypatch):
    import shardwise.telemetry.comm.tap as tap_mod

    monkeypatch.setattr(tap_mod, "MAX_PENDING", 2)
    # device time = host time: every call's end event completes 0.2 s after the clock started
    clock = FakeClock([0.0, 0.2] * 4, speed=1.0)
    tap = _tap(world1, clock)
    try:
        tap.begin_step(1)
        for _ in range(4):
            dist.all_reduce(torch.ones(4))
        step = tap.end_step()  # 4 > MAX_PENDING: waits until at most 1 is left
    finally:
        tap.uninstall()
    assert step.unresolved <= 1 and time.perf_counter() - clock.t0 >= 0.2
