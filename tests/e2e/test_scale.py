"""`shardwise scale` through the real command line at 1, 2 and 4 local workers: the table, the
efficiency recomputed from each run's metrics.jsonl, the page with its plot, the runs forming a
controlled comparison of layouts; and every bad --world refused before anything trains."""

from __future__ import annotations

import base64
import io
import json
import statistics
from pathlib import Path

import pytest
from PIL import Image

from shardwise.cli.main import main
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.cli import assert_user_error, shardwise
from tests.support.specs import tiny_spec_dict

TARGET = 5.9


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def config(small_corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scale") / "tiny.toml"
    path.write_text(spec_to_toml(spec_from_dict(tiny_spec_dict(
        small_corpus, path.parent / "unused", eval={"every": 2})).validate()))
    return path


@pytest.fixture(scope="module")
def study(config) -> tuple[Path, str]:
    out = config.parent / "study"
    proc = shardwise("scale", str(config), "--world", "1,2,4", "--steps", "6", "--target-loss",
                     str(TARGET), "--out", str(out), cwd=config.parent, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.grid  # 37 s; scale's arithmetic is unit-tested, the command runs in the grid
@pytest.mark.timeout(420)
def test_scaling_at_one_two_and_four_workers(study):
    out, stdout = study
    saved = json.loads((out / "scale.json").read_text())
    assert saved["mode"] == "strong" and saved["target_loss"] == TARGET
    points = saved["points"]
    assert [p["world"] for p in points] == [1, 2, 4]
    tps = {}
    for p in points:
        evs = events(out / f"world-{p['world']}")
        start = next(e for e in evs if e["kind"] == "run_start")
        assert start["world_size"] == p["world"] and p["global_batch"] == 8  # strong: fixed
        steps = [e for e in evs if e["kind"] == "step"]
        tps[p["world"]] = statistics.median(e["tokens_per_s"] for e in steps[1:])
        assert p["tokens_per_s"] == tps[p["world"]]
        windows = [e["tokens_per_s"] for e in steps[1:]]
        assert p["tokens_per_s_se"] == pytest.approx(
            (3.141592653589793 / 2) ** 0.5 * statistics.stdev(windows) / len(windows) ** 0.5)
        evals = [e for e in evs if e["kind"] == "eval"]
        hit = next((e for e in evals if e["val_loss"] <= TARGET), None)
        assert p["tokens_to_target"] == (hit["step"] * 256 if hit else None)
        if p["world"] > 1:  # collectives: a share of the step, measured
            assert 0 < p["comm_share"] < 1
    for p in points:
        assert p["efficiency"] == pytest.approx(tps[p["world"]] / (tps[1] * p["world"]))
    lines = stdout.splitlines()
    assert lines[0].startswith("strong scaling (fixed global batch)")
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "4"]
    assert "comparison of the runs: controlled" in stdout
    html = (out / "index.html").read_text()
    png = html.split('id="plot-scaling"')[1].split("base64,")[1].split('"')[0]
    assert Image.open(io.BytesIO(base64.b64decode(png))).size[0] == 1000
    assert 'id="scorecard"' in html and "<script" not in html


@pytest.mark.grid  # reads `study` (1, 2 and 4 workers: 34 s of set-up)
def test_the_sizes_are_a_controlled_comparison_of_layouts(study, capsys):
    out, _ = study
    code = main(["compare", *(str(out / f"world-{w}") for w in (1, 2, 4)), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["controlled"] is True and len(result["sides"]) == 3
    kinds = {d["name"]: d["kind"] for d in result["differences"]}
    assert {"parallel.nproc", "topology.layout", "topology.world_size"} <= set(kinds)
    assert set(kinds.values()) == {"infrastructure"}


@pytest.mark.parametrize(("world", "extra", "needle"), [
    ("1,x", [], "is not a list of world sizes"),
    ("2", [], "a scaling study needs at least two"),
    ("1,0", [], "0 is not a world size"),
    ("2,2", [], "repeats a size"),
    ("1,3", [], "world size 3 cannot run this job"),  # 8 sequences over 3 ranks
    ("3,4", ["--weak"], "not a whole number"),
])
def test_a_bad_world_list_is_refused_before_training(config, tmp_path, capsys, world, extra,
                                                     needle):
    out = tmp_path / "never"
    code = main(["scale", str(config), "--world", world, "--out", str(out), *extra])
    _, err = capsys.readouterr()
    assert_user_error((code, "", err), needle)
    assert not (out / "world-1" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.grid
@pytest.mark.timeout(600)
def test_a_hugging_face_model_scales(small_corpus, tmp_path):
    """examples/hf_llama.toml (transformers, offline) at 1 and 2 workers."""
    pytest.importorskip("transformers")
    from tests.support.specs import ROOT

    sets = [f'data.source="{small_corpus}"', "data.seq_len=32", "batch.micro_batch=2",
            "eval.every=2", "eval.batches=1", "log.every=1", "log.progress=false",
            "log.tensorboard=false", "checkpoint.enabled=false", "sample.tokens=0"]
    proc = shardwise("scale", str(ROOT / "examples" / "hf_llama.toml"), "--world", "1,2",
                     "--steps", "4", *(a for s in sets for a in ("--set", s)), "--out",
                     str(tmp_path / "study"), cwd=tmp_path, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    points = json.loads((tmp_path / "study" / "scale.json").read_text())["points"]
    assert [p["world"] for p in points] == [1, 2] and all(p["tokens_per_s"] for p in points)
    assert points[0]["efficiency"] == 1.0
