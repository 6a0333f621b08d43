"""Run a function on N local ranks and collect what each returns (tests and benchmarks).

Two ways, one interface (`run_ranks`):

- **pooled** (the default): one set of spawned ranks per world size lives for the whole pytest
  run and runs one job after another, each on its own prefix of the pool's store and its own
  process group, so a test pays for its steps, not for spawning Python and importing torch
  (2-5 s per test on a 2-core machine). Every job starts from the process state a fresh rank
  has: the parent's environment (as spawn would copy it), torch's thread count, seed and
  determinism flag, the signal handlers. A job that fails, hangs, kills a rank or leaves
  something behind (a process group, a Python thread, a patched torch function) retires its
  ranks: the next job gets new ones.
- **fresh** (`fresh=True`): spawned for this call and gone after it, for what tests start-up
  itself or measures a whole process (peak memory, restarts).

The parent binds the store on port 0 (the OS picks a free port), so runs never collide on a fixed
port, and every call is bounded by a timeout after which its ranks are killed and the test fails
instead of hanging CI.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from shardwise.parallel.distributed import forget_meshes
from shardwise.run.agent import CRASH_SIGNALS, NATIVE_CRASH

#: how long a finished job waits for threads it started to end before the ranks count as dirty
_THREAD_GRACE_S = 2.0
#: after one rank dies, how long to wait for the others to report their own errors
_DEATH_GRACE_S = 20.0
#: native threads a rank may gain over its start before it retires. Each gloo process group runs
#: its own threads (measured: 7 `gloo_tcp_loop` and 14 `pt_gloo_runloop` per rank for one ZeRO-3
#: run at world 2), which end only when the group object is freed, and a job's groups sit in
#: reference cycles: a rank had gathered 671 threads after ~40 jobs and spent a fifth of a core
#: polling while idle, slowing every test beside it. Collecting the garbage after each job frees
#: them, but in one CI rehearsal a later world-4 job then failed to resolve its own process group
#: by name (cause not pinned down; the names restart at 0 in every job), so the harness does not
#: collect; it retires a rank once it holds this many extra threads (about ten jobs), well before
#: they cost CPU.
_NATIVE_THREADS_GROWTH = 256


def _rank_env(rank: int, world: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world)}


def _report(results: Any, key: Any, rank: int, fn: Callable[..., Any], store: Any,
            args: tuple[Any, ...]) -> None:
    try:
        # Plain pickle copies tensors; the queue's own pickler would share them through memory
        # that vanishes when this process exits.
        results.put((key, rank, True, pickle.dumps(fn(store, *args))))
    except BaseException:  # report every failure to the parent, with its traceback
        results.put((key, rank, False, traceback.format_exc()))


# --- fresh ranks ----------------------------------------------------------------------------

def _fresh_child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...],
                 results: Any, env: dict[str, str]) -> None:
    faulthandler.enable(all_threads=True)  # a native crash prints every thread's stack
    os.environ.update(env)
    os.environ.update(_rank_env(rank, world))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    _report(results, 0, rank, fn, store, args)


def _fresh(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float,
           env: dict[str, str]) -> list[Any]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=_fresh_child, args=(fn, r, world, store.port, args, results, env))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(results, 0, procs, timeout)
    finally:
        _stop(procs, grace=5.0)


# --- pooled ranks ---------------------------------------------------------------------------

def _torch_snapshot() -> dict[str, int]:
    """Identities of what a job could patch process-wide: torch.distributed's functions and
    torch.Tensor's attributes. Equal before and after a job means nothing was left patched."""
    snap = {f"dist.{k}": id(v) for k, v in vars(dist).items() if callable(v)}
    snap.update({f"Tensor.{k}": id(v) for k, v in vars(torch.Tensor).items()})
    return snap


def _catchable_signals() -> list[signal.Signals]:
    return [s for s in signal.valid_signals()
            if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)]


def _serve(rank: int, world: int, port: int, jobs: Connection, results: Any) -> None:
    """A pooled rank: run jobs until the parent closes the pipe, each from a fresh rank's state."""
    # a native crash (SIGSEGV, a heap check's SIGABRT) prints every thread's Python stack into
    # the test's captured stderr; the failure message names the jobs this rank had run before
    faulthandler.enable(all_threads=True)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    threads, seed = torch.get_num_threads(), torch.initial_seed()
    deterministic = torch.are_deterministic_algorithms_enabled()
    handlers = {s: signal.getsignal(s) for s in _catchable_signals()}
    patched = _torch_snapshot()
    native = _native_threads()
    results.put(("ready", rank, None, []))  # starts the queue's feeder thread before any job
    while True:
        try:
            job = jobs.recv()
        except EOFError:
            return
        if job is None:
            return
        key, fn, args, environ = job
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(_rank_env(rank, world))
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(deterministic)
        before = set(threading.enumerate())
        _report(results, key, rank, fn, dist.PrefixStore(f"job-{key}/", store), args)
        results.put((key, rank, None, _leftovers(before, handlers, patched, native)))


def _native_threads() -> int | None:
    """This process's native threads (Linux), or None where /proc does not say."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _leftovers(before: set[threading.Thread], handlers: dict[signal.Signals, Any],
               patched: dict[str, int], native: int | None) -> list[str]:
    """What a job left that a fresh rank would not have (empty: the rank may run another job).
    Signal handlers are put back; the rest cannot be undone from outside and retires the rank."""
    left = []
    if dist.is_initialized():
        left.append("a process group")
        dist.destroy_process_group()
    forget_meshes()  # the product's own clean-up, for a job that left its group
    deadline = time.monotonic() + _THREAD_GRACE_S
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            left.append(f"thread {thread.name!r}")
    for sig, handler in handlers.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
    now = _torch_snapshot()
    changed = sorted(k for k, v in patched.items() if now.get(k) != v)
    if changed:
        left.append(f"patched torch functions ({', '.join(changed[:4])})")
    now_native = _native_threads()
    if native is not None and now_native is not None \
            and now_native - native > _NATIVE_THREADS_GROWTH:
        left.append(f"{now_native - native} more native threads than at start")
    return left


class RankPool:
    """`world` spawned ranks that run jobs one after another (see the module docstring)."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.world = world
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        self.results = ctx.Queue()
        self.pipes: list[Connection] = []
        self.procs = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, self.store.port, child,
                                                    self.results), name=f"pool{world}-rank{rank}")
            proc.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.jobs = 0
        self.leftovers: list[str] = []
        self.history: list[str] = []  # the tests whose jobs these ranks ran, oldest first

    def run(self, key: int, fn: Callable[..., Any], args: tuple[Any, ...], timeout: float,
            env: dict[str, str]) -> list[Any]:
        """Run one job; raises AssertionError (and leaves the pool unusable) if any rank fails."""
        environ = {**os.environ, **env}
        for pipe in self.pipes:
            pipe.send((key, fn, args, environ))
        self.jobs += 1
        early: dict[int, list[str]] = {}
        try:
            out = _collect(self.results, key, self.procs, timeout, early)
        except AssertionError as err:
            # memory corrupted by an earlier job can surface in a later one: name them
            if any(p.exitcode is not None and p.exitcode < 0 for p in self.procs) and self.history:
                err.add_note(f"these pooled ranks had run {len(self.history)} job(s) before, "
                             f"the last: {'; '.join(self.history[-8:])}")
            raise
        self.history.append(os.environ.get("PYTEST_CURRENT_TEST", "?").removesuffix(" (call)"))
        self.leftovers = _collect_leftovers(self.results, key, self.procs, 30.0, early)
        return out

    @property
    def usable(self) -> bool:
        return not self.leftovers and all(p.is_alive() for p in self.procs)

    def close(self, grace: float = 5.0) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
                pipe.close()
            except OSError:
                pass
        _stop(self.procs, grace)


_POOLS: dict[int, RankPool] = {}
_KEYS = itertools.count()
#: every pool started in this process, and (world, job count, reason) for every pool retired
#: before the end of the run: what cost a respawn (pytest prints both at the end)
STARTED: list[RankPool] = []
RETIRED: list[tuple[int, int, str]] = []


def _pooled(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float,
            env: dict[str, str]) -> list[Any]:
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = RankPool(world)
        STARTED.append(pool)
    try:
        out = pool.run(next(_KEYS), fn, args, timeout, env)
    except BaseException as e:
        _retire(world, f"{type(e).__name__}")
        raise
    if not pool.usable:
        _retire(world, ", ".join(pool.leftovers) or "a rank exited")
    return out


def _retire(world: int, reason: str) -> None:
    pool = _POOLS.pop(world, None)
    if pool is not None:
        RETIRED.append((world, pool.jobs, reason))
        pool.close(grace=0.5)


@atexit.register
def close_pools() -> None:
    """End every pooled rank (pytest's exit; also safe to call between tests)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


# --- shared ---------------------------------------------------------------------------------

def _collect(results: Any, key: Any, procs: list[Any], timeout: float,
             cleanups: dict[int, list[str]] | None = None) -> list[Any]:
    """Each rank's result for job `key`, in rank order; AssertionError naming every failure.
    A rank's clean-up report (pooled ranks) read on the way goes into `cleanups`."""
    world = len(procs)
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(out) < world and not errors:
        try:
            got_key, rank, ok, value = results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in out and not p.is_alive()]
            if dead:
                # give the live ranks a moment to report their own errors (a closed connection)
                deadline = min(deadline, time.monotonic() + _DEATH_GRACE_S)
                if time.monotonic() >= deadline or len(dead) == world - len(out):
                    errors += [f"rank {r} exited with code {code} before reporting"
                               for r, code in dead]
            elif time.monotonic() >= deadline:
                errors.append(f"timed out after {timeout} s; ranks done: {sorted(out)}")
            continue
        if got_key != key:
            continue  # a pooled rank's start-up message
        if ok is None:
            if cleanups is not None:
                cleanups[rank] = value
            continue
        if ok:
            out[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
    if errors:
        crashed = _crashed(procs, errors)
        if crashed:
            raise RankCrashed(f"{crashed} ({NATIVE_CRASH}; its stack is in the captured "
                              "stderr, from the \"Fatal Python error\" line)\n" + "\n".join(errors))
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]


class RankCrashed(AssertionError):
    """A rank died of a crash signal (SIGSEGV, SIGABRT, ...) while the job ran: a fault in
    native code, not an assertion of the test (tests/README.md: how CI treats it)."""


#: the signals of a crash, as `run.agent` names them for launched workers
_CRASH_SIGNALS = tuple(getattr(signal, name) for name in CRASH_SIGNALS)


def _crashed(procs: list[Any], errors: list[str]) -> str:
    """"rank R died of SIGNAL" for each rank that died of a crash signal, or "". A peer's
    "Connection closed/reset by peer" is often reported before the crashed rank is reaped: give
    it a moment then."""
    deadline = time.monotonic() + (5.0 if any("by peer" in e for e in errors) else 0.0)
    while True:
        dead = [(r, signal.Signals(-p.exitcode).name) for r, p in enumerate(procs)
                if p.exitcode is not None and -p.exitcode in _CRASH_SIGNALS]
        if dead or time.monotonic() >= deadline:
            return ", ".join(f"rank {r} died of {name}" for r, name in dead)
        time.sleep(0.1)


def _collect_leftovers(results: Any, key: Any, procs: list[Any], timeout: float,
                       cleanups: dict[int, list[str]]) -> list[str]:
    """Every rank's clean-up report for job `key`: what the job left behind, rank by rank."""
    deadline = time.monotonic() + timeout
    while len(cleanups) < len(procs):
        try:
            got_key, rank, ok, value = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return ["a rank did not finish cleaning up"]
        if got_key == key and ok is None:
            cleanups[rank] = value
    return [f"rank {rank}: {item}" for rank, items in sorted(cleanups.items()) for item in items]


def _stop(procs: list[Any], grace: float) -> None:
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180,
              env: dict[str, str] | None = None, fresh: bool = False) -> list[Any]:
    """`fn(store, *args)` on ranks 0..world-1, each with RANK/WORLD_SIZE/LOCAL_* set and a store
    of its own job; returns their results in rank order, or raises AssertionError with every
    failing rank's traceback. `fn` must be importable by the spawn start method (module level).
    `fresh=True` spawns new processes for this call alone."""
    if fresh:
        return _fresh(fn, world, args, timeout, dict(env or {}))
    return _pooled(fn, world, args, timeout, dict(env or {}))
