"""The pooled ranks of tests/support/ranks.py keep every job as isolated as fresh processes would:
a clean job reuses the ranks, and every way a job can spoil them (an error, a hang, a dead rank,
a leftover thread, process group or patched torch function) retires them, so the next job runs
on new processes. Jobs here are trivial: these tests pay for the pool, not for training."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.support import ranks
from tests.support.ranks import run_ranks


def _state(store: Any) -> dict[str, Any]:
    """What a job sees of its process; also spoils what a later job must not inherit."""
    seen = {"pid": os.getpid(), "threads": torch.get_num_threads(),
            "env": os.environ.get("POOL_TEST_VAR"), "rank": int(os.environ["RANK"]),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "draw": torch.rand(1).item(), "leak": os.environ.get("POOL_TEST_LEAK")}
    torch.set_num_threads(1 if seen["threads"] > 1 else 2)
    torch.use_deterministic_algorithms(not seen["deterministic"])
    torch.rand(5)
    os.environ["POOL_TEST_LEAK"] = "leaked"
    return seen


def _group(store: Any) -> float:
    """A real collective on the job's own store prefix; the group is left for the pool to end."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_1(store: Any) -> int:
    if int(os.environ["RANK"]) == 1:
        raise ValueError("planted failure")
    return os.getpid()


def _hang_on_rank_0(store: Any) -> int:
    if int(os.environ["RANK"]) == 0:
        time.sleep(600)
    return os.getpid()


def _exit_rank_0(store: Any) -> int:
    if int(os.environ["RANK"]) == 0:
        os._exit(3)
    return os.getpid()


def _abort_rank_0_in_a_collective(store: Any) -> int:
    """Rank 0 dies of SIGABRT (what glibc's heap checks raise) while rank 1 waits for it."""
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=2)
    if int(os.environ["RANK"]) == 0:
        os.abort()
    dist.barrier()
    return os.getpid()


def _leave_thread(store: Any) -> int:
    threading.Thread(target=time.sleep, args=(30,), daemon=True, name="left-behind").start()
    return os.getpid()


def _patch_torch(store: Any) -> int:
    dist.all_reduce = lambda *a, **k: None  # never restored
    return os.getpid()


def _pids(store: Any) -> int:
    return os.getpid()


def test_a_clean_job_reuses_the_ranks_from_a_fresh_state(monkeypatch):
    first = run_ranks(_state, 2, timeout=60)
    monkeypatch.setenv("POOL_TEST_VAR", "set-by-the-test")
    second = run_ranks(_state, 2, timeout=60)
    assert [r["rank"] for r in second] == [0, 1]
    assert [r["pid"] for r in second] == [r["pid"] for r in first]  # the same processes
    for a, b in zip(first, second, strict=True):
        # what the first job changed is back to a fresh rank's value
        assert (b["threads"], b["deterministic"], b["draw"]) == (a["threads"], a["deterministic"],
                                                                 a["draw"])
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in second] == ["set-by-the-test"] * 2  # the parent's environment
    assert [r["leak"] for r in second] == [None, None]  # not the first job's


def test_a_job_left_process_group_is_ended_and_the_ranks_retired():
    before = len(ranks.RETIRED)
    assert run_ranks(_group, 2, timeout=60) == [3.0, 3.0]
    assert len(ranks.RETIRED) == before + 1 and "a process group" in ranks.RETIRED[-1][2]
    assert run_ranks(_group, 2, timeout=60) == [3.0, 3.0]  # new ranks, a new group


@pytest.mark.parametrize("job, needle", [  # 6-10 s each
    pytest.param(_fail_on_rank_1, "rank 1 failed:\nTraceback", marks=pytest.mark.grid),
    pytest.param(_exit_rank_0, "rank 0 exited with code 3", marks=pytest.mark.grid),
    pytest.param(_hang_on_rank_0, "timed out after 3 s", marks=pytest.mark.grid),
])
def test_a_spoiled_job_fails_and_the_next_runs_on_new_ranks(job, needle):
    pids = run_ranks(_pids, 2, timeout=60)
    with pytest.raises(AssertionError, match=needle.replace("(", r"\(")) as failure:
        run_ranks(job, 2, timeout=3)
    assert not isinstance(failure.value, ranks.RankCrashed)  # not rerun as a native crash
    after = run_ranks(_pids, 2, timeout=60)
    assert not set(after) & set(pids)


def test_a_rank_crash_is_named_with_the_jobs_before_it():
    """A crash signal fails the job as RankCrashed (pyproject reruns such a test once), naming
    the rank, the signal and the tests whose jobs these ranks ran before (memory one of them
    corrupted may be what crashed). An ordinary exit stays an AssertionError (above)."""
    run_ranks(_pids, 2, timeout=60)
    with pytest.raises(ranks.RankCrashed, match="rank 0 died of SIGABRT") as crash:
        run_ranks(_abort_rank_0_in_a_collective, 2, timeout=60)
    assert "a crash in native code" in str(crash.value)
    assert "test_a_rank_crash_is_named_with_the_jobs_before_it" in "".join(crash.value.__notes__)


@pytest.mark.parametrize("job, reason", [
    pytest.param(_leave_thread, "thread 'left-behind'", marks=pytest.mark.grid),
    (_patch_torch, "patched torch functions (dist.all_reduce")])
def test_what_a_job_leaves_behind_retires_the_ranks(job, reason):
    pids = run_ranks(job, 2, timeout=60)
    assert reason in ranks.RETIRED[-1][2]
    assert not set(run_ranks(_pids, 2, timeout=60)) & set(pids)


@pytest.mark.grid  # 8 s: two fresh spawns
def test_fresh_ranks_are_new_processes_every_call():
    a, b = run_ranks(_pids, 2, fresh=True), run_ranks(_pids, 2, fresh=True)
    assert not set(a) & set(b)
