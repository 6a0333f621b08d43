"""Run a function on N spawned local ranks and collect what each returns (tests, benchmarks).

The parent binds a TCPStore on port 0 (a free port chosen by the OS), so tests never collide on a
fixed port; every rank gets 1 intra-op thread per core it shares; every run is bounded by a
timeout after which all ranks are killed and the test fails instead of hanging CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
           results: mp.Queue, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        # Plain pickle copies tensors; the queue's own pickler would share them through memory
        # that vanishes when this process exits.
        results.put((rank, True, pickle.dumps(fn(store, *args))))
    except BaseException:  # report every failure to the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180,
              env: dict[str, str] | None = None) -> list[Any]:
    """`fn(store, *args)` on ranks 0..world-1, each with RANK/WORLD_SIZE/LOCAL_* set and a client
    of the parent's store; returns their results in rank order. `fn` must be importable by the
    spawn start method (module level)."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    results: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_child,
                         args=(fn, r, world, store.port, args, results, dict(env or {})))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break  # the others will fail on a closed connection or be killed below
    except queue.Empty:
        errors.append(f"timed out after {timeout} s; ranks done: {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]
