"""Per-call cost of the comm tap's wrapper, in microseconds, on one process (no GPU needed).

The tap wraps a collective that does nothing (a stand-in for `all_reduce` installed before the tap),
so the figure is the wrapper alone: group lookup, the backend/device check, bytes, the flight
record, the timing and the bookkeeping of a host-timed (CPU) call. A real world-1 gloo
`all_reduce` of the same tensor is timed too, for scale. Blocks of calls alternate between the
modes; the figure per mode is the median of the blocks' per-call means (and the best block).

`--against OTHER/src/shardwise/telemetry/comm` loads another version of the tap beside this one
and alternates the two in the same process, block by block — the fair comparison on a shared
machine (separate processes see different load). The tap is a package (`telemetry/comm/`); a
version from before it was one is its single file, `--against OTHER/src/shardwise/telemetry/comm.py`.
Either way the other tap's own modules are loaded, and this version's rest of shardwise (compat,
comm_theory) serves both:

    PYTHONPATH=src python benchmarks/bench_tap.py
    PYTHONPATH=src python benchmarks/bench_tap.py --against /path/to/main/src/shardwise/telemetry/comm
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import shardwise
from shardwise.resilience.flight import FlightRecorder
from shardwise.telemetry.comm.tap import CommTap


def _noop(tensor: torch.Tensor, op: object = None, group: object = None,
          async_op: bool = False) -> None:
    return None


def _per_call_us(call: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls * 1e6


def _load_tap(path: str) -> type:
    """The CommTap of another version: its `telemetry/comm/` package, or the single
    `telemetry/comm.py` of a version from before the tap was a package."""
    if Path(path).is_dir():
        return _load_tap_package(Path(path))
    spec = importlib.util.spec_from_file_location("other_comm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.CommTap


def _load_tap_package(directory: Path) -> type:
    """The other package's modules import each other by their full names
    (`shardwise.telemetry.comm.calls`, ...): they are loaded under those names while this
    version's are set aside, which are put back once the other tap is loaded."""
    package = "shardwise.telemetry.comm"
    parent = sys.modules["shardwise.telemetry"]

    def ours() -> dict[str, object]:
        return {name: module for name, module in sys.modules.items()
                if name == package or name.startswith(package + ".")}

    mine, attribute = ours(), parent.comm
    for name in mine:
        del sys.modules[name]
    try:
        spec = importlib.util.spec_from_file_location(
            package, directory / "__init__.py", submodule_search_locations=[str(directory)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
        return importlib.import_module(f"{package}.tap").CommTap
    finally:
        for name in ours():
            del sys.modules[name]
        sys.modules.update(mine)
        parent.comm = attribute


def _against(other: type, blocks: int, calls: int, tensor: torch.Tensor,
             recorder: FlightRecorder) -> None:
    """This tap and `other` on the no-op collective, alternating block by block."""
    axes = {dist.group.WORLD.group_name: "dp"}
    c10d.all_reduce = dist.all_reduce = _noop
    times: dict[str, list[float]] = {"this": [], "other": []}
    for _ in range(blocks):
        for name, cls in (("this", CommTap), ("other", other)):
            tap = cls(axes, recorder).install()
            tap.begin_step(1)
            times[name].append(_per_call_us(lambda: dist.all_reduce(tensor), calls))
            tap.end_step()
            tap.uninstall()
    for name, values in times.items():
        print(f"  {name:6s} tap: median {statistics.median(values):6.2f} us/call, "
              f"best block {min(values):6.2f}")
    ratios = [a / b for a, b in zip(times["this"], times["other"], strict=True)]
    print(f"  this/other per block: median {statistics.median(ratios):.3f} "
          f"(10th-90th percentile {statistics.quantiles(ratios, n=10)[0]:.3f}-"
          f"{statistics.quantiles(ratios, n=10)[-1]:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--against", help="another version's telemetry/comm package (or, from "
                        "before it was one, its telemetry/comm.py) to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor = torch.ones(256)
    real = c10d.all_reduce
    with tempfile.TemporaryDirectory() as tmp:
        recorder = FlightRecorder(Path(tmp), 0, 1)
        if args.against:
            print(f"this tap: {Path(shardwise.__file__).parent}; other: {args.against}")
            _against(_load_tap(args.against), args.blocks, args.calls, tensor, recorder)
            c10d.all_reduce = dist.all_reduce = real
            recorder.close()
            dist.destroy_process_group()
            return
        axes = {dist.group.WORLD.group_name: "dp"}
        results: dict[str, list[float]] = {"noop, no tap": [], "noop, tap": [],
                                           "gloo all_reduce, no tap": [], "gloo all_reduce, tap": []}
        for _ in range(args.blocks):
            for name, fn in (("noop", _noop), ("gloo all_reduce", real)):
                for tapped in (False, True):
                    c10d.all_reduce = dist.all_reduce = fn
                    tap = CommTap(axes, recorder).install() if tapped else None
                    if tap is not None:
                        tap.begin_step(1)
                    calls = args.calls if name == "noop" else args.calls // 10
                    us = _per_call_us(lambda: dist.all_reduce(tensor), calls)
                    if tap is not None:
                        tap.end_step()
                        tap.uninstall()
                    results[f"{name}, {'tap' if tapped else 'no tap'}"].append(us)
        c10d.all_reduce = dist.all_reduce = real
        recorder.close()
    dist.destroy_process_group()
    print(f"shardwise from {Path(shardwise.__file__).parent}, torch {torch.__version__}, "
          f"{args.blocks} blocks")
    for name, values in results.items():
        print(f"  {name:26s} median {statistics.median(values):7.2f} us/call, "
              f"best block {min(values):7.2f}")
    wrapper = [t - n for t, n in zip(results["noop, tap"], results["noop, no tap"], strict=True)]
    print(f"  tap wrapper alone          median {statistics.median(wrapper):7.2f} us/call")


if __name__ == "__main__":
    main()
