"""The sample ledger: exact coverage across a resume at another data-parallel degree, and a
planted duplicate, omission and superseded (crashed) launch each judged right."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardwise.cli.main import main
from shardwise.data.ledger import audit, to_ranges
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single


def test_to_ranges():
    assert to_ranges(np.array([5, 0, 1, 2, 7, 6])) == [[0, 3], [5, 8]]
    assert to_ranges(np.array([3, 3])) == [[3, 4], [3, 4]]  # a duplicate stays visible


def test_resume_at_another_degree_is_exact_and_plants_are_caught(small_corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    first = tiny_spec(small_corpus, run_dir, run={"steps": 6, "stop_at": 3},
                      checkpoint={"enabled": True}, parallel={"dp_shard": 2, "nproc": 2})
    run_ranks(train, 2, first)
    second = tiny_spec(small_corpus, run_dir, run={"steps": 6}, checkpoint={"enabled": True})
    train_single(second, resume=True)

    report = audit(run_dir)
    assert report.exact, report.problems
    assert (report.steps, report.samples, report.launches) == (6, 6 * 8, 2)
    assert main(["verify", "--ledger", str(run_dir)]) == 0
    assert "ledger exact: 6 steps, 48 samples" in capsys.readouterr().out

    # rank 1 of launch 0 claims a sample that rank 0 used at step 2
    rank1 = run_dir / "ledger" / "rank-00001.jsonl"
    clean = rank1.read_text()
    rank1.write_text(clean + json.dumps({"launch": 0, "step": 2, "ranges": [[8, 9]]}) + "\n")
    assert main(["verify", "--ledger", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "step 2: sample 8 used twice (data-parallel ranks 0 and 1)" in out

    # rank 1's record of step 3 is lost: samples inside the step never used
    rank1.write_text("\n".join(line for line in clean.splitlines()
                               if json.loads(line)["step"] != 3) + "\n")
    problems = audit(run_dir).problems
    assert any(p.startswith("step 3:") and "never used" in p for p in problems), problems
    rank1.write_text(clean)


def test_a_crashed_launch_is_superseded(tmp_path):
    """Launch 0 ran steps 1-3 but its last checkpoint was step 2; launch 1 resumed from step 2
    and re-ran step 3 with the same samples: the re-run is not a duplicate."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    (ledger / "launches.jsonl").write_text(
        '{"launch": 0, "start_step": 0, "world_size": 1}\n'
        '{"launch": 1, "start_step": 2, "world_size": 1}\n')
    lines = [(0, 1, [[0, 4]]), (0, 2, [[4, 8]]), (0, 3, [[8, 12]]), (1, 3, [[8, 12]]),
             (1, 4, [[12, 16]])]
    (ledger / "rank-00000.jsonl").write_text("".join(
        json.dumps({"launch": la, "step": s, "ranges": r}) + "\n" for la, s, r in lines))
    report = audit(tmp_path)
    assert report.exact and report.steps == 4 and report.samples == 16


def _write_ledger(root, launches, lines):
    ledger = root / "ledger"
    ledger.mkdir(parents=True)
    (ledger / "launches.jsonl").write_text("".join(json.dumps(e) + "\n" for e in launches))
    by_rank: dict[int, list[str]] = {}
    for rank, record in lines:
        by_rank.setdefault(rank, []).append(json.dumps(record) + "\n")
    for rank, text in by_rank.items():
        (ledger / f"rank-{rank:05d}.jsonl").write_text("".join(text))


def test_audit_checks_replicas_batch_size_and_declared_skips(tmp_path):
    launch = {"launch": 0, "start_step": 0, "world_size": 4, "dp": 2, "global_batch": 4}
    good = [(0, {"launch": 0, "step": 1, "dp_rank": 0, "ranges": [[0, 2]]}),
            (2, {"launch": 0, "step": 1, "dp_rank": 1, "ranges": [[2, 4]]})]
    _write_ledger(tmp_path / "ok", [launch], good)
    assert audit(tmp_path / "ok").exact

    # a replica that wrote nothing, and a tp peer that wrote the same replica's record again
    peer = (1, {"launch": 0, "step": 1, "dp_rank": 0, "ranges": [[0, 2]]})
    _write_ledger(tmp_path / "missing", [launch], [good[0], peer])
    problems = audit(tmp_path / "missing").problems
    assert any("data-parallel ranks [1] of 2 wrote no record" in p for p in problems), problems
    assert any("recorded it more than once" in p for p in problems), problems

    # a step that used fewer samples than the global batch
    _write_ledger(tmp_path / "short", [launch], [
        (0, {"launch": 0, "step": 1, "dp_rank": 0, "ranges": [[0, 2]]}),
        (2, {"launch": 0, "step": 1, "dp_rank": 1, "ranges": [[2, 3]]})])
    assert any("3 samples used, but the global batch" in p
               for p in audit(tmp_path / "short").problems)

    # a rollback declared [4, 8) skipped; the next launch trained on sample 6 anyway
    single = {"launch": 0, "start_step": 0, "world_size": 1, "dp": 1, "global_batch": 2}
    rollback = {"launch": 1, "start_step": 2, "world_size": 1, "dp": 1, "global_batch": 2,
                "skipped": [4, 8]}
    _write_ledger(tmp_path / "skips", [single, rollback], [
        (0, {"launch": 0, "step": 1, "dp_rank": 0, "ranges": [[0, 2]]}),
        (0, {"launch": 0, "step": 2, "dp_rank": 0, "ranges": [[2, 4]]}),
        (0, {"launch": 0, "step": 3, "dp_rank": 0, "ranges": [[4, 6]]}),
        (0, {"launch": 1, "step": 3, "dp_rank": 0, "ranges": [[6, 8]]})])
    problems = audit(tmp_path / "skips").problems
    assert any("declared skipped by a rollback but trained on" in p for p in problems), problems


@pytest.mark.grid  # the same audit runs by default through `verify` on tp/pp (test_verify.py)
def test_tp_and_pp_peers_record_once_per_replica(small_corpus, tmp_path):
    """tp and pp ranks of one data-parallel replica read the same samples: one record each step
    (measured before: every rank wrote, and the audit reported each sample used twice)."""
    model = {"n_layers": 4, "tie_embeddings": False}
    for name, parallel in (("tp2", {"tp": 2, "dp_shard": 1}),
                           ("pp2xzero3-2", {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"})):
        world = 4 if name == "pp2xzero3-2" else 2
        run_dir = tmp_path / name
        spec = tiny_spec(small_corpus, run_dir, model=model, run={"steps": 3},
                         parallel={**parallel, "nproc": world})
        run_ranks(train, world, spec)
        report = audit(run_dir)
        assert report.exact, (name, report.problems)
        assert (report.steps, report.samples) == (3, 3 * 8), name
        writers = sorted(p.name for p in (run_dir / "ledger").glob("rank-*.jsonl")
                         if p.read_text().strip())
        assert len(writers) == (2 if name == "pp2xzero3-2" else 1), (name, writers)
