"""Numerics guard: a non-finite gradient skips the step; `failure.nan_patience` of them in a row
roll back to the last checkpoint and skip the offending batches, declared in the ledger."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from shardwise.data.ledger import audit
from shardwise.errors import UserError
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.ranks import run_ranks
from tests.support.specs import grid, tiny_spec, tiny_spec_dict
from tests.support.workers import train, train_single


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == kind]


def test_nan_steps_are_skipped_then_rolled_back(small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 8},
                     checkpoint={"enabled": True, "every": 2},
                     failure={"faults": "nan:step=3;nan:step=4", "nan_patience": 2})
    result = train_single(spec)
    bad = events(run_dir, "nonfinite")
    assert [(e["step"], e["consecutive"]) for e in bad] == [(3, 1), (4, 2)]
    (rollback,) = events(run_dir, "rollback")
    assert rollback["step"] == 2 and rollback["path"].endswith("step-000002")
    assert rollback["skipped_samples"] == [16, 32]  # steps 3 and 4: 2 x global batch 8
    assert result["step"] == 8
    assert all(math.isfinite(x) for x in result["losses"][-6:])
    report = audit(run_dir)
    assert report.exact, report.problems
    assert (report.steps, report.skipped) == (8, 16)


# the distributed optimizer and the flat all-reduce (zero 1 / 0 under tp or pp) with small
# gradient buckets, most of which start in backward: the poisoned rank must reduce the NaN
POISONED = {"zero3-2": {"dp_shard": 2, "nproc": 2},
            "zero1-2+tp2": {"dp_shard": 2, "zero": 1, "tp": 2, "nproc": 4, "bucket_mb": 0.004},
            "ddp2+pp2": {"dp_replicate": 2, "dp_shard": 1, "zero": 0, "pp": 2, "nproc": 4,
                         "bucket_mb": 0.004}}


@pytest.mark.parametrize("layout", grid(POISONED, default=("zero3-2",)))
def test_patience_zero_only_skips(layout, small_corpus, tmp_path):
    run_dir = tmp_path / "run"
    parallel = POISONED[layout]
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 4},
                     failure={"faults": "nan:rank=1:step=2", "nan_patience": 0},
                     parallel=parallel)
    result = run_ranks(train, parallel["nproc"], spec)[0]
    assert [e["step"] for e in events(run_dir, "nonfinite")] == [2]
    assert not events(run_dir, "rollback")
    assert math.isnan(result["grad_norms"][1]) and math.isfinite(result["grad_norms"][2])
    assert all(math.isfinite(x) for x in result["losses"])


def test_rollback_to_a_checkpoint_inside_the_streak_never_retrains_skipped(small_corpus, tmp_path):
    """Steps 3-5 are non-finite; the checkpoint of step 4 was saved inside the streak, so the
    rollback resumes at sample 32, inside the declared range [16, 40): the cursor must jump to
    40 (an equality match would re-train samples 32-39), and the audit must agree."""
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 8},
                     checkpoint={"enabled": True, "every": 2},
                     failure={"faults": "nan:step=3;nan:step=4;nan:step=5", "nan_patience": 3})
    result = train_single(spec)
    (rollback,) = events(run_dir, "rollback")
    assert rollback["step"] == 4 and rollback["skipped_samples"] == [16, 40]
    assert result["step"] == 8
    ranks = [json.loads(line) for line in (run_dir / "ledger" / "rank-00000.jsonl")
             .read_text().splitlines()]
    after = [r for r in ranks if r["launch"] == 1]
    assert after[0]["step"] == 5 and after[0]["ranges"] == [[40, 48]]
    assert all(b <= 16 or a >= 40 for r in after for a, b in r["ranges"])
    report = audit(run_dir)
    assert report.exact, report.problems
    assert (report.steps, report.skipped) == (8, 8)


def test_rollbacks_are_capped_per_launch(small_corpus, tmp_path):
    """#26 item 6: a state that diverges again after every rollback ends the run with one
    paragraph after `failure.max_rollbacks` (before: it rolled back forever, skipping more data
    each time)."""
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"steps": 12},
                     checkpoint={"enabled": True, "every": 2},
                     failure={"faults": "nan:step=3;nan:step=5;nan:step=7", "nan_patience": 1,
                              "max_rollbacks": 2})
    with pytest.raises(UserError, match=r"diverged again.*after 2 rollbacks in this launch "
                                        r"\(samples \[16, 24\), \[40, 48\) skipped\)"):
        train_single(spec)
    assert [e["step"] for e in events(run_dir, "rollback")] == [2, 4]


@pytest.mark.grid  # an elastic restart: ~15 s
@pytest.mark.timeout(240)
def test_a_rollbacks_skip_survives_a_crash_before_the_next_save(small_corpus, tmp_path):
    """#26 item 6: the skipped range is written when the rollback happens (RUN_DIR/
    skipped.json), so a worker killed before the next checkpoint restarts from the older
    checkpoint and still never trains the batches that diverged (before: the skip lived only in
    the data cursor, saved with the next checkpoint, and the restart trained them again)."""
    run_dir = tmp_path / "run"
    data = tiny_spec_dict(small_corpus, run_dir, run={"dir": str(run_dir), "steps": 6},
                          checkpoint={"enabled": True, "every": 2, "async_save": False},
                          parallel={"nproc": 2, "dp_shard": 2},
                          failure={"faults": "nan:step=3;kill:rank=1:step=4:phase=forward",
                                   "nan_patience": 1, "max_restarts": 1})
    config = tmp_path / "job.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", str(config)], cwd=tmp_path,
                          text=True, capture_output=True, timeout=200)  # (the killed attempt
    assert proc.returncode == 0, proc.stderr  # prints its ranks' tracebacks: not checked here)
    (rollback,) = events(run_dir, "rollback")
    assert rollback["skipped_samples"] == [16, 24]
    assert json.loads((run_dir / "skipped.json").read_text()) == [[16, 24]]
    (restart,) = events(run_dir, "restart")
    assert restart["resumed_from_step"] == 2  # the step-2 checkpoint, saved before the skip
    trained = [json.loads(line) for f in sorted((run_dir / "ledger").glob("rank-*.jsonl"))
               for line in f.read_text().splitlines()]
    assert all(b <= 16 or a >= 24 for r in trained if r["launch"] >= 1 for a, b in r["ranges"])
    report = audit(run_dir)
    assert report.exact, report.problems
    assert (report.steps, report.skipped) == (6, 8)
