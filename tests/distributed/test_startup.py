"""Start-up that never races a collective timeout (#26 item 5): the ranks meet between start-up
phases in the launcher's store, so one rank preparing for longer than `parallel.timeout_s` (a
cold corpus tokenized on one node, a large model directory hashed by rank 0) delays the run and
fails nothing. Before, the others waited for it in an all-reduce bounded by that timeout."""

from __future__ import annotations

import pytest

from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train_with_slow_start


@pytest.mark.grid  # 9 s
@pytest.mark.timeout(120)
def test_a_rank_slower_than_the_collective_timeout_at_start_up_fails_nothing(small_corpus,
                                                                             tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 2},
                     parallel={"nproc": 2, "dp_shard": 2, "timeout_s": 4})
    assert run_ranks(train_with_slow_start, 2, spec, 1, 7.0, timeout=100) == [2, 2]
