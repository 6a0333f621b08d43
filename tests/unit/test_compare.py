"""`shardwise compare` on synthetic run directories (spec.toml, manifest.json, metrics.jsonl written
here, so every number below is known): which differences are infrastructure, the verdict against
the seed spread, every scorecard figure against the events it is read from, the exit codes, the
page, and every bad input as one paragraph."""

from __future__ import annotations

import base64
import io
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from shardwise.cli.main import main
from shardwise.compare import compare_runs, load_run_data
from shardwise.compare.fields import INFRASTRUCTURE, OTHER, SEED, kind_of
from shardwise.spec import RunSpec, spec_to_toml

T0 = 1_800_000_000.0
TOKENS_PER_STEP = 1024


def write_run(path: Path, *, spec: RunSpec | None = None, seed: int = 7, losses=None,
              tps=None, world: int = 1, layout: str = "single", commit: str = "abc",
              content: str = "c0ffee", extra_steps: dict | None = None,
              end: dict | None = None, checkpoints=(), restarts=(), energy=None) -> Path:
    """A run directory as `shardwise train` leaves one: 8 steps logged every step, held-out
    loss every 2 steps (`losses`, 4 values), tokens/s per window (`tps`, 8 values)."""
    spec = (spec or RunSpec()).replace("run", seed=seed, dir=str(path))
    spec = spec.replace("data", content_hash=content, tokenizer_hash="70ce")
    losses = losses or [6.0, 5.5, 5.1, 4.9]
    tps = tps or [500.0, 1000.0, 1010.0, 990.0, 1005.0, 995.0, 1020.0, 1000.0]
    path.mkdir(parents=True)
    (path / "spec.toml").write_text(spec_to_toml(spec))
    (path / "manifest.json").write_text(json.dumps({
        "run_id": path.name, "data": {"content_sha256": content, "tokenizer_sha256": "70ce",
                                      "path": f"/data/{path.name}.txt"},
        "code": {"shardwise": "0.1.0", "git_commit": commit, "dirty": False, "diff_sha256": None},
        "model": {"source": {"family": "gpt", "shardwise": "0.1.0"}},
        "environment": {"python": "3.11.7", "torch": "2.13.0", "packages_sha256": "p"},
        "topology": {"world_size": world, "layout": layout, "hosts": ["h"],
                     "devices": ["cpu (x86_64)"] * world}}))
    events = [ev("run_start", 0, 0.0, world_size=world, layout=layout, device="cpu",
                 tokens_per_step=TOKENS_PER_STEP)]
    t = 0.0
    for step in range(1, 9):
        t += TOKENS_PER_STEP / tps[step - 1]
        fields = dict(loss=7.0 - 0.2 * step, tokens_per_s=tps[step - 1],
                      step_time_s=TOKENS_PER_STEP / tps[step - 1], mfu=tps[step - 1] / 1e5,
                      tokens_seen=step * TOKENS_PER_STEP, comm_bytes=4096, comm_time_s=0.1,
                      step_time_p99_s_per_rank=[1.5 * TOKENS_PER_STEP / tps[step - 1]] * world,
                      compute_s_per_rank=[1.0] * world, peak_mem_bytes=2**30 + step)
        if energy is not None:
            fields.update(energy_j=energy[step - 1], energy_source="rapl")
        fields.update((extra_steps or {}).get(step, {}))
        events.append(ev("step", step, t, **fields))
        if step % 2 == 0:
            t += 0.05
            events.append(ev("eval", step, t, val_loss=losses[step // 2 - 1], eval_tokens=256))
    for step, fields in checkpoints:
        events.append(ev("checkpoint", step, t, **fields))
    for fields in restarts:
        events.append(ev("restart", 8, t, **fields))
    events.append(ev("run_end", 8, t + 0.01, tokens_seen=8 * TOKENS_PER_STEP,
                     wall_s=t, goodput=0.9, **(end or {})))
    (path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def ev(kind: str, step: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "run_id": "x", "rank": 0, "step": step, "time": T0 + t, **fields}


def run_cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["compare", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def flat(text: str) -> str:
    return " ".join(text.split())


# --- which differences are infrastructure ------------------------------------------------------

@pytest.mark.parametrize(("name", "kind"), [
    ("parallel.dp_shard", INFRASTRUCTURE), ("parallel.tp", INFRASTRUCTURE),
    ("run.precision", INFRASTRUCTURE), ("memory.activation_checkpoint", INFRASTRUCTURE),
    ("batch.micro_batch", INFRASTRUCTURE), ("optimizer.implementation", INFRASTRUCTURE),
    ("topology.devices", INFRASTRUCTURE), ("code.git_commit", INFRASTRUCTURE),
    ("environment.torch", INFRASTRUCTURE), ("model.source.transformers", INFRASTRUCTURE),
    ("optimizer.lr", OTHER), ("optimizer.schedule", OTHER), ("batch.global_batch", OTHER),
    ("data.content_hash", OTHER), ("data.val_fraction", OTHER), ("eval.batches", OTHER),
    ("model.d_model", OTHER), ("model.source.sha256", OTHER), ("run.steps", OTHER),
    ("budget.tokens", OTHER), ("eval.tokens", OTHER), ("a.field.nobody.classified", OTHER),
    ("run.seed", SEED),
])
def test_every_field_has_a_kind(name, kind):
    assert kind_of(name) == kind


def test_two_layouts_and_precisions_are_a_controlled_comparison(tmp_path, capsys):
    a = write_run(tmp_path / "zero3", world=2, layout="zero3-2",
                  spec=RunSpec().replace("parallel", nproc=2))
    b = write_run(tmp_path / "ddp-bf16", world=2, layout="ddp-2", commit="def",
                  spec=RunSpec().replace("parallel", nproc=2, dp_shard=1, dp_replicate=2)
                  .replace("run", precision="bf16"))
    code, out, _ = run_cli(str(a), str(b), capsys=capsys)
    assert code == 0, out
    assert "CONTROLLED — only infrastructure differs" in out
    c = compare_runs([load_run_data(str(a)), load_run_data(str(b))])
    assert c.controlled and len(c.sides) == 2
    names = {d.name: d.kind for d in c.differences}
    assert names == {"parallel.dp_shard": INFRASTRUCTURE, "parallel.dp_replicate": INFRASTRUCTURE,
                     "run.precision": INFRASTRUCTURE, "topology.layout": INFRASTRUCTURE,
                     "code.git_commit": INFRASTRUCTURE}
    assert (a / "compare" / "index.html").is_file() and (a / "compare" / "comparison.json").is_file()


def test_a_changed_learning_rate_is_refused_unless_allowed(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", spec=RunSpec().replace("optimizer", lr=1e-3))
    code, out, _ = run_cli(str(a), str(b), "--no-page", capsys=capsys)
    assert code == 3 and not (a / "compare").exists()
    assert "NOT CONTROLLED" in out and "optimizer.lr" in out and "<- not infrastructure" in out
    assert "B vs A: no winner called — the runs differ in optimizer.lr" in flat(out)
    code, out, _ = run_cli(str(a), str(b), "--allow", "optimizer.lr", "--no-page", capsys=capsys)
    assert code == 0 and "(and, allowed: optimizer.lr)" in out
    assert run_cli(str(a), str(b), "--allow", "optimizer", "--no-page", capsys=capsys)[0] == 0
    code, out, err = run_cli(str(a), str(b), "--allow", "optimizer.lrr", capsys=capsys)
    assert code == 2 and out == "" and "Did you mean optimizer.lr" in flat(err)


def test_a_different_dataset_is_refused_but_a_copied_one_is_the_same(tmp_path, capsys):
    a = write_run(tmp_path / "a", spec=RunSpec().replace("data", source="/x/plays.txt"))
    other = write_run(tmp_path / "other", content="deadbeef",
                      spec=RunSpec().replace("data", source="/x/plays.txt"))
    copied = write_run(tmp_path / "copied", spec=RunSpec().replace("data", source="/y/copy.txt"))
    code, out, _ = run_cli(str(a), str(other), "--no-page", capsys=capsys)
    assert code == 3 and "data.content_hash" in out
    c = compare_runs([load_run_data(str(a)), load_run_data(str(copied))])
    assert c.controlled and not c.differences  # same content hash: the path does not matter


def test_scorecard_figures_equal_what_the_events_say(tmp_path):
    tps = [400.0, 900.0, 950.0, 1000.0, 1100.0, 1050.0, 980.0, 1020.0]
    a = write_run(tmp_path / "a", tps=tps, losses=[6.0, 5.4, 5.0, 4.8],
                  checkpoints=[(8, {"bytes": 8_000_000, "write_s": 2.0, "stall_s": 0.5})],
                  restarts=[{"seconds_to_first_step": 7.5}], end={"startup_s": 3.0},
                  energy=[10.0] * 8)
    b = write_run(tmp_path / "b", tps=[2 * v for v in tps], losses=[6.0, 5.4, 5.0, 4.8],
                  energy=[6.0] * 8, world=2, layout="zero3-2",
                  spec=RunSpec().replace("parallel", nproc=2))
    c = compare_runs([load_run_data(str(a)), load_run_data(str(b))], target_loss=5.2, price=2.0)
    events = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    # throughput: the median of every logged step but the first (the warm-up)
    assert c.row("tokens_per_s").stats[0].mean == statistics.median(tps[1:])
    assert c.row("mfu").stats[0].mean == pytest.approx(statistics.median(tps[1:]) / 1e5)
    # held-out loss at the largest token count both evaluated
    assert c.equal_tokens == 8 * TOKENS_PER_STEP and c.row("heldout_loss").stats[0].mean == 4.8
    # time to target: the first evaluation at or below 5.2 is step 6, in training time
    hit = next(e for e in events if e["kind"] == "eval" and e["val_loss"] <= 5.2)
    assert hit["step"] == 6
    assert c.row("time_to_target").stats[0].mean == pytest.approx(hit["time"] - events[0]["time"])
    assert c.row("tokens_to_target").stats[0].mean == 6 * TOKENS_PER_STEP
    assert c.row("tokens_to_target").verdicts[1] == "equal (same evaluation step)"
    assert c.row("time_to_target").verdicts[1].startswith("faster")
    # step time, comm, checkpoint, restart, memory, energy and cost
    assert c.row("step_p50").stats[0].mean == pytest.approx(
        statistics.median(e["step_time_s"] for e in steps[1:]))
    assert c.row("comm_bytes").stats[0].mean == 4096
    assert c.row("comm_share").stats[0].mean == pytest.approx(
        statistics.median(0.1 / e["step_time_s"] for e in steps[1:]))
    assert c.row("ckpt_bandwidth").stats[0].mean == 4_000_000
    assert c.row("ckpt_stall").stats[0].mean == 0.5 and c.row("restart").stats[0].mean == 7.5
    assert c.row("peak_host").stats[0].mean == 2**30 + 8
    assert c.row("energy").stats[0].mean == 80.0 and c.row("energy").stats[1].mean == 48.0
    assert c.row("energy_per_token").stats[0].mean == pytest.approx(80.0 / (8 * TOKENS_PER_STEP))
    assert c.row("energy_to_target").stats[0].mean == 60.0  # the 6 steps before the evaluation
    training = events[-1]["time"] - events[0]["time"]
    assert c.row("training_time").stats[0].mean == pytest.approx(training)
    assert c.row("cost").stats[0].mean == pytest.approx(2.0 * (training + 3.0) / 3600)
    assert c.row("tokens_per_s").verdicts[1] == "faster"
    assert c.verdicts[0].startswith("B vs A: B wins — held-out loss identical")


def _seeds(tmp_path: Path, name: str, losses: list[float], **kw: Any) -> list[Path]:
    return [write_run(tmp_path / f"{name}-s{seed}", seed=seed, losses=[6.0, 5.5, 5.1, loss], **kw)
            for seed, loss in zip((1, 2, 3), losses, strict=True)]


def test_quality_is_judged_against_the_seed_spread(tmp_path, capsys):
    a = _seeds(tmp_path, "a", [4.90, 4.92, 4.94])  # sd 0.02
    near = _seeds(tmp_path, "near", [4.91, 4.93, 4.95], world=2, layout="ddp-2",
                  spec=RunSpec().replace("parallel", nproc=2))
    far = _seeds(tmp_path, "far", [5.10, 5.12, 5.14], world=4, layout="ddp-4",
                 spec=RunSpec().replace("parallel", nproc=4))
    c = compare_runs([load_run_data(str(p)) for p in (*a, *near, *far)])
    assert [s.label for s in c.sides] == ["A", "B", "C"] and [len(s.runs) for s in c.sides] == [3] * 3
    assert c.noise.sigma == pytest.approx(0.02)  # pooled over the three sides
    se = 0.02 * (2 / 3) ** 0.5
    row = c.row("heldout_loss")
    assert row.delta(1) == pytest.approx(0.01) and row.delta(2) == pytest.approx(0.2)
    assert row.verdicts[1] == f"within seed noise (|Δ| ≤ 2σ = {2 * se:.4f})"
    assert row.verdicts[2].startswith("worse beyond seed noise")
    assert c.verdicts[1].startswith("C vs A: A wins — held-out loss worse")
    code, out, _ = run_cli(*map(str, (*a, *near)), "--no-page", capsys=capsys)
    assert code == 0 and "4.9200 ± 0.0200 (n=3)" in out and "seed 1, 2, 3" in out
    # one run per side: no spread, so no quality verdict; a given --noise is used and named
    single = compare_runs([load_run_data(str(a[0])), load_run_data(str(far[0]))])
    assert single.row("heldout_loss").verdicts[1].startswith("no seed spread")
    given = compare_runs([load_run_data(str(a[0])), load_run_data(str(far[0]))], noise=0.01)
    assert given.noise.source.startswith("given (--noise 0.01)")
    assert given.row("heldout_loss").verdicts[1].startswith("worse")


def test_runs_that_differ_only_in_seed_are_one_side(tmp_path, capsys):
    runs = _seeds(tmp_path, "a", [4.90, 4.95, 5.00])
    code, out, _ = run_cli(*map(str, runs), "--no-page", capsys=capsys)
    assert code == 0 and "one side (3 runs that differ only in their seed)" in out
    assert "4.9500 ± 0.0500 (n=3)" in out


def test_a_target_one_side_misses(tmp_path):
    a = write_run(tmp_path / "a", losses=[6.0, 5.5, 5.1, 4.9])
    b = write_run(tmp_path / "b", losses=[6.0, 5.8, 5.6, 5.5], world=2, layout="ddp-2",
                  spec=RunSpec().replace("parallel", nproc=2))
    c = compare_runs([load_run_data(str(a)), load_run_data(str(b))], target_loss=5.0)
    row = c.row("time_to_target")
    assert row.texts == [None, "not reached (best 5.5000)"]
    assert row.verdicts[1] == "worse: did not reach it"
    assert c.notes == [n for n in c.notes if "energy" in n or "price" in n]


def test_the_page_has_the_scorecard_and_its_plots(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", world=2, layout="ddp-2", tps=[900.0] * 8,
                  spec=RunSpec().replace("parallel", nproc=2))
    out = tmp_path / "page"
    assert run_cli(str(a), str(b), "--out", str(out), "--target-loss", "5.2", capsys=capsys)[0] == 0
    html = (out / "index.html").read_text()
    assert 'id="scorecard"' in html and 'id="differences"' in html and "<script" not in html
    images = dict(_images(html))
    assert set(images) == {"plot-cmp-heldout", "plot-cmp-target", "plot-cmp-speed",
                           "plot-cmp-relative"}
    for png in images.values():
        assert Image.open(io.BytesIO(png)).size[0] == 1000
    saved = json.loads((out / "comparison.json").read_text())
    assert saved["controlled"] is True and saved["target_loss"] == 5.2
    # `shardwise report A B` carries the same comparison after its summary
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "report")]) == 0
    capsys.readouterr()
    page = (tmp_path / "report" / "index.html").read_text()
    assert page.index('id="summary"') < page.index('id="scorecard"')


def _images(html: str):
    import re

    for m in re.finditer(r'<img id="([^"]+)"[^>]*src="data:image/png;base64,([^"]+)"', html):
        yield m.group(1), base64.b64decode(m.group(2))


@pytest.mark.parametrize("case", ["one-run", "missing", "no-metrics", "no-spec", "no-manifest",
                                  "twice", "noise-zero", "negative-price"])
def test_bad_input_is_one_paragraph(case, tmp_path, capsys):
    good = str(write_run(tmp_path / "good"))
    other = tmp_path / "other"
    args = [good, str(other)]
    if case == "one-run":
        args = [good]
    elif case == "no-metrics":
        other.mkdir()
    elif case in ("no-spec", "no-manifest"):
        write_run(other)
        (other / ("spec.toml" if case == "no-spec" else "manifest.json")).unlink()
    elif case == "twice":
        args = [good, good]
    elif case == "noise-zero":
        write_run(other)
        args += ["--noise", "0"]
    elif case == "negative-price":
        write_run(other)
        args += ["--price", "-1"]
    code, out, err = run_cli(*args, capsys=capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("error:") == 1
    expected = {"one-run": "at least two run directories", "missing": "does not exist",
                "no-metrics": "has no metrics.jsonl", "no-spec": "has no spec.toml",
                "no-manifest": "has no manifest.json", "twice": "given twice",
                "noise-zero": "--noise 0", "negative-price": "--price -1"}[case]
    assert expected in flat(err)


def test_runs_without_a_spec_are_not_taken_for_one_job(tmp_path):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    for run in (a, b):
        (run / "spec.toml").unlink()
    c = compare_runs([load_run_data(str(a), require_record=False),
                      load_run_data(str(b), require_record=False)])
    assert len(c.sides) == 2 and not c.controlled
    assert [d.name for d in c.pair_blocking(1)] == ["spec"]
    assert c.verdicts[0].startswith("B vs A: no winner called — the runs differ in spec")


def test_a_damaged_spec_fails_compare_but_not_report(tmp_path, capsys):
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    (b / "spec.toml").write_text("[run]\nsteps = 'many'\n")
    code, out, err = run_cli(str(a), str(b), capsys=capsys)
    assert code == 2 and out == "" and f"cannot read {b / 'spec.toml'}" in flat(err)
    # what `report A B` builds its comparison section from: a note, not an error
    from shardwise.report.scorecard import comparison_section

    damaged = load_run_data(str(b), require_record=False)
    assert any("cannot read" in note for note in damaged.run.notes)
    html = comparison_section(compare_runs([load_run_data(str(a), require_record=False), damaged]))
    assert "Not controlled" in html and "no spec.toml" in html


def test_the_report_summary_shows_target_energy_and_audit(tmp_path):
    from shardwise.report import load_run
    from shardwise.report.summary import summary_rows

    def row(run_dir: Path, label: str) -> str:
        return dict(summary_rows([load_run(str(run_dir))]))[label][0]

    run = write_run(tmp_path / "a", losses=[6.0, 5.4, 5.0, 4.8], energy=[20.0] * 8,
                    end={"target_loss": 5.2})
    (run / "audit.json").write_text(json.dumps({
        "passed": False, "exact": [{"held_out": 0, "trained": 5, "similarity": 1.0}], "near": [],
        "held_out": {"sequences": 371, "evaluated": 8, "repeats_within": 0}}))
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    hit = next(e for e in events if e["kind"] == "eval" and e["val_loss"] <= 5.2)
    seconds = hit["time"] - events[0]["time"]
    assert row(run, "target loss") == f"5.2 at step 6 (6,144 tokens, {seconds:.1f} s of training)"
    assert row(run, "energy") == f"0.16 kJ (rapl), {1000 * 160 / 8192:.3f} mJ/token"
    assert row(run, "leakage audit") == \
        "FAIL: 1 exact, 0 near-duplicates among 371 held-out sequences"
    missed = write_run(tmp_path / "b", end={"target_loss": 1.0})
    lines = [json.loads(x) for x in (missed / "metrics.jsonl").read_text().splitlines()]
    lines.insert(1, ev("energy", 1, 0.1, source=None, note="no RAPL counters on this host"))
    (missed / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert row(missed, "target loss") == "1 not reached (best 4.9000)"
    assert row(missed, "energy") == "not measurable here: no RAPL counters on this host"
    assert row(missed, "leakage audit") == f"not run (shardwise audit {missed})"
