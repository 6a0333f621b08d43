"""Automatic restart: a worker killed at any phase of any step (checkpoint writes included) is
restarted by the elastic agent, every rank resumes from the newest valid checkpoint, and the run
ends in exactly the state of the uninterrupted run (invariant mode: bitwise), with an exact
sample ledger."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.verify.layouts import parse_layout
from shardwise.verify.runner import layout_spec, run_layout
from tests.support.specs import tiny_spec

KILLS = [  # (rank, step, phase): every phase, several steps, both ranks, mid-checkpoint-write
    (0, 1, "forward"), (1, 2, "backward"), (0, 2, "checkpoint-write"), (1, 3, "data"),
    (0, 3, "optimizer"), (1, 4, "forward"), (0, 4, "checkpoint-write"), (1, 4, "backward"),
    (0, 5, "data"), (1, 5, "optimizer"), (0, 6, "backward"), (1, 6, "checkpoint-write"),
]


def _config(small_corpus, tmp_path):
    from shardwise.spec import spec_from_dict, spec_to_toml
    from tests.support.specs import tiny_spec_dict

    config = tmp_path / "job.toml"
    data = tiny_spec_dict(small_corpus, tmp_path / "unused",
                          run={"determinism": "invariant"},
                          checkpoint={"enabled": True, "every": 2})
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))
    return str(config)


def _run(config, run_dir, overrides):
    layout = parse_layout("zero3-2")
    spec = layout_spec(config, overrides, layout, run_dir, steps=6)
    spec = spec.replace("checkpoint", enabled=True, every=2)
    return run_layout(run_dir.name, spec, run_dir)


@pytest.fixture(scope="module")
def reference(small_corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart-ref")
    return _run(_config(small_corpus, tmp), tmp / "uninterrupted", [])


# `pytest -m grid` runs all twelve kills (the default run resumes in e2e/test_resume_rule.py)
DEFAULT_KILLS: set[tuple[int, int, str]] = set()  # 14-30 s each: all twelve under `grid`


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("rank", "step", "phase"), [
    pytest.param(*k, id=f"rank{k[0]}-step{k[1]}-{k[2]}",
                 marks=() if k in DEFAULT_KILLS else pytest.mark.grid) for k in KILLS])
def test_killed_worker_restarts_and_matches_uninterrupted(rank, step, phase, reference,
                                                          small_corpus, tmp_path):
    config = _config(small_corpus, tmp_path)
    outcome = _run(config, tmp_path / "run",
                   ["failure.max_restarts=1",
                    f'failure.faults="kill:rank={rank}:step={step}:phase={phase}"'])
    events = [json.loads(line) for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    restart = [e for e in events if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["attempt"] == 1
    assert restart[0]["seconds_to_first_step"] > 0
    assert outcome.ledger_exact, outcome.ledger_problems
    assert outcome.losses[-1] == reference.losses[-1]
    for name, value in reference.params.items():
        assert torch.equal(outcome.params[name], value), name
    for name, value in reference.optim.items():
        assert torch.equal(outcome.optim[name], value), name


def test_fault_specs_are_validated():
    from shardwise.errors import SpecError
    from shardwise.resilience.faults import parse_faults

    (fault,) = parse_faults("kill:rank=1:step=3:phase=backward")
    assert (fault.kind, fault.rank, fault.step, fault.phase) == ("kill", 1, 3, "backward")
    with pytest.raises(SpecError, match="unknown fault kind 'explode'"):
        parse_faults("explode:rank=1")
    with pytest.raises(SpecError, match="unknown fault phase 'lunch'"):
        parse_faults("kill:phase=lunch")
    with pytest.raises(SpecError, match=r"failure\.faults: unknown fault option 'when'"):
        tiny_spec(".", ".", failure={"faults": "kill:when=now"})
