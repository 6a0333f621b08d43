"""`shardwise verify`: layout names, the parity table, a restart, and a failing tolerance."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from shardwise.errors import UserError
from shardwise.spec import spec_from_dict, spec_to_toml
from shardwise.verify.layouts import parse_layout
from tests.support.specs import tiny_spec_dict
from tests.support.verify import verify_pooled


@pytest.mark.parametrize(("name", "world", "expect"), [
    ("dp1", 1, {}),
    ("ddp2", 2, {"dp_replicate": 2, "dp_shard": 1, "zero": 0}),
    ("zero1-2", 2, {"dp_shard": 2, "zero": 1}),
    ("zero3-4", 4, {"dp_shard": 4, "zero": 3}),
    ("hsdp-2x2", 4, {"dp_replicate": 2, "dp_shard": 2}),
    ("tp2", 2, {"tp": 2, "sequence_parallel": True}),
    ("tp2-nosp", 2, {"tp": 2, "sequence_parallel": False}),
    ("pp2-interleaved", 2, {"pp": 2, "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 2}),
    ("zero3-2+tp2", 4, {"dp_shard": 2, "tp": 2}),
    ("tp2×pp2", 4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
])
def test_layout_names(name, world, expect):
    layout = parse_layout(name)
    assert layout.world_size == world
    for key, value in expect.items():
        assert layout.parallel[key] == value


def test_unknown_layout_name_is_a_user_error():
    with pytest.raises(UserError, match="cannot read the layout 'zero9-2'"):
        parse_layout("zero9-2")


def _verify(small_corpus, tmp_path, *args):
    config = tmp_path / "tiny.toml"
    config.write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(small_corpus, tmp_path / "unused"))
                                   .validate()))
    return subprocess.run([sys.executable, "-m", "shardwise", "verify", str(config),
                           "--out", str(tmp_path / "verify"), *args],
                          cwd=tmp_path, text=True, capture_output=True, timeout=280)


@pytest.mark.timeout(300)
@pytest.mark.grid  # bitwise invariance itself runs by default in test_invariant.py
def test_invariant_layouts_and_restart_pass_bitwise(small_corpus, tmp_path):
    proc = _verify(small_corpus, tmp_path, "--layouts", "dp1,zero3-2", "--steps", "4",
                   "--restart-at", "2", "--resume-layout", "ddp2",
                   "--set", 'run.determinism="invariant"')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tolerance bitwise" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("zero3-2", "dp1@2"))]
    assert len(rows) == 2 and all(" yes " in r and "exact" in r and r.endswith("ok") for r in rows)
    assert "verify: PASS" in proc.stdout


@pytest.mark.grid  # 16 s; verify's pass path runs in the default
@pytest.mark.timeout(300)
def test_a_tolerance_the_layout_cannot_meet_fails(small_corpus, tmp_path):
    """fast mode differs from the reference in the last bits: rtol 1e-15 must fail (exit 1)."""
    proc = _verify(small_corpus, tmp_path, "--layouts", "dp1,zero3-2", "--steps", "3",
                   "--rtol", "1e-15")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "verify: FAIL" in proc.stdout


@pytest.mark.parametrize("args", [
    pytest.param(["--layouts", "dp1,zero3-4"], id="layout"),
    pytest.param(["--layouts", "dp1", "--restart-at", "2", "--resume-layout", "zero3-4"],
                 id="resume-layout", marks=pytest.mark.grid)])
def test_every_layout_is_checked_before_any_trains(small_corpus, tmp_path, args):
    """zero3-4 needs global_batch to be a multiple of micro_batch 8 x dp 4 = 32; dp1 (first) could
    run. The refusal comes before dp1 trains: exit 2, the layout named, no run directory."""
    t0 = time.perf_counter()
    proc = _verify(small_corpus, tmp_path, *args, "--steps", "4",
                   "--set", "batch.global_batch=16", "--set", "batch.micro_batch=8")
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = " ".join(proc.stderr.split())
    assert message.startswith("error: layout ") and "zero3-4 cannot run this job" in message
    assert "batch.global_batch (16) is not a multiple of batch.micro_batch (8) * data-parallel " \
           "degree (4) = 32" in message
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    out = tmp_path / "verify"
    assert not out.exists() or list(out.iterdir()) == []
    assert seconds < 60, seconds  # start-up and data preparation only (a training run adds more)


@pytest.mark.timeout(300)
def test_tensor_and_pipeline_layouts_pass_with_an_exact_ledger(small_corpus, tmp_path):
    """Measured before: every number well inside 1e-5, yet `verify: FAIL` with the ledger BAD on
    each tp/pp layout (every tp/pp peer recorded the replica's samples)."""
    proc = _verify(small_corpus, tmp_path, "--layouts", "dp1,tp2,pp2-1f1b", "--steps", "3",
                   "--set", "model.tie_embeddings=false", "--set", "model.n_layers=4",
                   "--set", "optimizer.lr=2e-3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("tp2", "pp2"))]
    assert len(rows) == 2 and all("exact" in r and r.endswith("ok") for r in rows), rows
    assert "verify: PASS" in proc.stdout


RESUME_SCHEDULES = [
    pytest.param(schedule, tied, id=f"{schedule}-{'tied' if tied else 'untied'}",
                 marks=pytest.mark.grid)  # the CLI's --restart-at: test_invariant_layouts_and_restart…
    for schedule in ("zero-bubble", "1f1b", "gpipe", "interleaved") for tied in (True, False)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "tied"), RESUME_SCHEDULES)
def test_resume_into_every_pipeline_schedule(small_corpus, tmp_path, schedule, tied):
    """#26 item 8: a run stopped at step 2 and resumed under each pipeline schedule, tied and
    untied, ends where the uninterrupted single process does. Before, resuming into the
    zero-bubble V with tied embeddings trained another model (‖Δp‖/‖p‖ 4.3e-3): the first and
    last stage's copies of the tied tensor sit on one rank, and after a load both optimizers
    stepped one shared AdamW state, twice per step. verify's comparison, the runs in the pooled
    ranks (tests/support/verify.py); the CLI's `--restart-at` runs in
    test_invariant_layouts_and_restart_pass_bitwise."""
    config = tmp_path / "tiny.toml"
    config.write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(small_corpus, tmp_path / "unused"))
                                   .validate()))
    (row,) = verify_pooled(config, "dp1", tmp_path / "verify",
                           f"model.tie_embeddings={'true' if tied else 'false'}",
                           "model.n_layers=4", "optimizer.lr=2e-3", steps=4, restart_at=2,
                           resume_layout=f"pp2-{schedule}")
    assert row.name == f"dp1@2->pp2-{schedule}" and row.ledger_exact and row.passed, row
