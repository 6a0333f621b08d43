"""The CUDA branch of the telemetry, on a real GPU: skipped where there is none (the default suite
needs no GPU). Written for a one-GPU machine — a world-1 NCCL group still routes every collective
through NCCL. Run with `pytest -q tests/gpu/test_gpu_telemetry.py` on a CUDA machine.

What the CPU tests cannot show and these do: that CUDA events, not host clocks, time NCCL calls
(a collective queued behind a busy GPU is unresolved at the end of the step and resolves later,
while the host never waited), that Work futures' callbacks give a valid end event, that the
backward hooks autograd runs on its CUDA thread count with the step, the guard against a CPU
tensor on NCCL, and that the matmul probe lands near the datasheet peak.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from shardwise.resilience.flight import FlightRecorder, read_flight
from shardwise.telemetry.comm.backends import BackendDeviceError
from shardwise.telemetry.comm.tap import CommTap
from shardwise.telemetry.peak import gpu_peak, measure_gpu_matmul_flops

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: about 1 s of a spinning kernel at ~2 GHz


@pytest.fixture
def nccl1() -> Iterator[str]:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))  # create the communicator outside the tests
        torch.cuda.synchronize()
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("async_op", [False, True])
def test_nccl_call_is_timed_on_the_device_and_resolves_lazily(nccl1, tmp_path, async_op):
    recorder = FlightRecorder(tmp_path, 0, 1)
    tap = CommTap({nccl1: "dp"}, recorder).install()
    x = torch.ones(16 << 20, device="cuda")
    try:
        tap.begin_step(1)
        torch.cuda._sleep(BUSY_CYCLES)  # the stream is busy: the collective runs ~1 s from now
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=async_op)
        step = tap.end_step()
        host_s = time.perf_counter() - t0
        assert host_s < 0.5, "the tap synchronised with the device on the hot path"
        assert not step.resolved and read_flight(recorder.path).calls[-1].done is False
        if work is not None:
            work.wait()
        torch.cuda.synchronize()
        # the watchdog's thread resolves it (and must not need the training thread's device)
        poller = threading.Thread(target=lambda: tap.poll(block=False))
        poller.start()
        poller.join()
        assert step.resolved and tap.poll() == 0
    finally:
        tap.uninstall()
        recorder.close()
    totals = step.by_op["all_reduce:dp"]
    assert step.resolved and totals.calls == 1 and totals.bytes == x.numel() * 4
    assert 0 < totals.time_s < 5 and step.inflight_s == pytest.approx(totals.time_s)
    assert read_flight(recorder.path).calls[-1].done


def test_functional_collective_ends_at_its_wait_on_cuda(nccl1):
    tap = CommTap({nccl1: "dp"}).install()
    try:
        tap.begin_step(1)
        out = funcol.all_reduce(torch.ones(1 << 20, device="cuda"), "sum", dist.group.WORLD)
        (out * 2).sum()  # first use: wait_tensor through the tap
        torch.cuda.synchronize()
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert step.resolved and step.device_intervals and step.by_op["all_reduce:dp"].time_s > 0


def test_backward_hooks_on_the_cuda_autograd_thread_count_with_the_step(nccl1):
    tap = CommTap({nccl1: "dp"}).install()
    try:
        tap.begin_step(1)
        w = torch.ones(1024, device="cuda", requires_grad=True)
        threads: list[int] = []

        def hook(grad: torch.Tensor) -> torch.Tensor:
            threads.append(threading.get_ident())
            dist.all_reduce(grad)
            return grad

        w.register_hook(hook)
        (w * 2).sum().backward()
        torch.cuda.synchronize()
        step = tap.end_step()
    finally:
        tap.uninstall()
    assert threads and threads[0] != threading.get_ident()  # the premise: autograd's own thread
    assert step.by_op["all_reduce:dp"].bytes == 4096 and tap.background == {}


def test_cpu_tensor_on_nccl_is_refused_with_the_fix(nccl1):
    tap = CommTap({nccl1: "dp_shard"}).install()
    try:
        with pytest.raises(BackendDeviceError, match=r"ctx\.device"):
            dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(4, device="cuda"))  # the right device passes
    finally:
        tap.uninstall()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_matmul_probe_is_near_the_datasheet_peak(precision):
    name = torch.cuda.get_device_name()
    table = gpu_peak(name, precision).flops
    if table is None:
        pytest.skip(f"no table entry for {name!r}")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    t0 = time.perf_counter()
    measured = measure_gpu_matmul_flops(dtype, 0.4)
    assert time.perf_counter() - t0 < 5
    # a dense matmul reaches 50-95% of the datasheet on H100/A100-class parts; above it is a bug
    assert 0.3 * table < measured < 1.05 * table, (name, precision, measured, table)
