"""`run.hooks` (`shardwise.train(hooks=[setup])`): a user's `setup(trainer)` adds hooks with
`trainer.add_hook` on every rank, they run after the built-in ones at their cadence with the
step's result, the manifest pins their file, and a missing hook fails before any worker starts."""

from __future__ import annotations

import json

import pytest

from shardwise.errors import SpecError, UserError
from shardwise.run.preflight import preflight
from tests.support.ranks import run_ranks
from tests.support.specs import tiny_spec
from tests.support.workers import train

HOOKS = '''
import json
from pathlib import Path


def setup(trainer):
    out = Path(trainer.run_dir) / f"hook-rank-{trainer.ctx.rank}.jsonl"

    def record(result):
        with out.open("a") as f:
            f.write(json.dumps({"step": result.step, "loss": result.loss}) + "\\n")

    trainer.add_hook(record, every=2, name="record")
'''


def test_user_hooks_run_on_every_rank_at_their_cadence(small_corpus, tmp_path):
    hooks = tmp_path / "my_hooks.py"
    hooks.write_text(HOOKS)
    run_dir = tmp_path / "run"
    spec = tiny_spec(small_corpus, run_dir, run={"hooks": (f"py:{hooks}:setup",)},
                     parallel={"dp_shard": 2})
    results = run_ranks(train, 2, spec)
    losses = results[0]["losses"]  # one per step, resolved at every step (log.every = 1)
    for rank in (0, 1):
        rows = [json.loads(line) for line in
                (run_dir / f"hook-rank-{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [2, 4, 5]  # every 2nd step, and the last
        assert [r["loss"] for r in rows] == [losses[1], losses[3], losses[4]]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["spec"]["run"]["hooks"] == [f"py:{hooks}:setup"]
    assert manifest["hooks"][0]["file"] == str(hooks)


def test_a_missing_hook_is_refused_before_any_worker_starts(small_corpus, tmp_path):
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"hooks": (f"py:{tmp_path}/no.py:setup",)})
    with pytest.raises(UserError, match=r"run\.hooks"):
        preflight(spec)
    with pytest.raises(SpecError, match=r"run\.hooks entry 'setup'"):
        tiny_spec(small_corpus, tmp_path / "run", run={"hooks": ("setup",)})
