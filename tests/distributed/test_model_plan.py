"""The model plan: any nn.Module under every layout its plan allows, tied tensors everywhere.

Models beside shardwise's GPT: `examples/custom_lm.py` (a user LM with LayerNorm, biases,
an nn.ModuleList of blocks and a tensor + pipeline plan; tied and untied) and
`tests/assets/models/bag_lm.py` (an nn.Sequential with no plan: data parallel only). Each layout trains
5 fp32 steps and is compared with the single process: per-step loss (1e-5 relative), the whole
parameter vector and the whole optimizer state (1e-5 relative in L2, no element off by more than
1e-4). Tied tensors must come back identical to each other, on every layout.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from shardwise.errors import SpecError, UserError
from shardwise.models import build_model
from shardwise.models.plan import ModelPlan, ModelShape, PlanError, plan_of
from shardwise.models.registry import describe_model
from shardwise.parallel.checks import check_layout
from shardwise.parallel.dims import ParallelDims
from shardwise.spec.model import ModelSection
from tests.support.compare import assert_model_close
from tests.support.ranks import run_ranks
from tests.support.specs import ASSETS, grid, tiny_spec
from tests.support.workers import train, train_single

MODELS = ASSETS / "models"
TINY = f"py:{Path(__file__).parents[2] / 'examples' / 'custom_lm.py'}:build"  # the example
BAG = f"py:{MODELS / 'bag_lm.py'}:build"
OPTIM = {"lr": 2e-3, "min_lr": 2e-4}

FAMILIES = {
    "tiny": {"family": TINY, "args": {"width": 32, "depth": 4, "heads": 4}},
    "tiny-tied": {"family": TINY, "args": {"width": 32, "depth": 4, "heads": 4, "tied": True}},
    "gpt-tied": {"n_layers": 4, "tie_embeddings": True},
    "bag": {"family": BAG, "args": {"width": 48}},
}
LAYOUTS = {
    "ddp2": (2, {"dp_replicate": 2, "dp_shard": 1}),
    "zero1-2": (2, {"dp_shard": 2, "zero": 1}),
    "zero3-2": (2, {"dp_shard": 2, "zero": 3}),
    "hsdp-2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
    "tp2": (2, {"tp": 2, "dp_shard": 1}),
    "tp2+sp": (2, {"tp": 2, "dp_shard": 1, "sequence_parallel": True}),
    "zero3-2xtp2": (4, {"dp_shard": 2, "tp": 2}),
    "pp2-1f1b": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b"}),
    # the planner's kind of split: more blocks on the first stage, the last runs the head + loss
    "pp2-1f1b-split31": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b",
                             "pp_layer_split": [3, 1]}),
    "pp2-zero-bubble": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "zero-bubble",
                            "pp_virtual_stages": 2}),
    "pp2xzero3-2": (4, {"pp": 2, "dp_shard": 2}),
    "tp2xpp2": (4, {"tp": 2, "pp": 2, "dp_shard": 1}),
}
CASES = [
    *((f, lay) for f in ("tiny", "tiny-tied") for lay in
      ("ddp2", "zero3-2", "tp2", "tp2+sp", "zero3-2xtp2", "pp2-1f1b", "pp2-zero-bubble",
       "pp2xzero3-2", "tp2xpp2")),
    *(("gpt-tied", lay) for lay in ("zero3-2", "tp2", "tp2+sp", "pp2-1f1b", "pp2-1f1b-split31",
                                    "pp2-zero-bubble", "tp2xpp2")),
    *(("bag", lay) for lay in ("ddp2", "zero1-2", "zero3-2", "hsdp-2x2")),
]
DEFAULT = {("tiny", "pp2-1f1b"), ("tiny-tied", "tp2"),
           ("tiny-tied", "pp2-zero-bubble"), ("gpt-tied", "tp2"),
           ("gpt-tied", "pp2-1f1b-split31"), ("bag", "zero3-2")}
TIED = {"tiny-tied": ("embed.weight", "head.weight"),
        "gpt-tied": ("tok_embeddings.weight", "output.weight")}


def _spec(corpus: Path, run_dir: Path, family: str, parallel: dict | None = None):
    return tiny_spec(corpus, run_dir, model=FAMILIES[family], optimizer=OPTIM,
                     parallel=parallel or {})


@pytest.fixture(scope="module")
def references(small_corpus, tmp_path_factory):
    cache: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in cache:
            cache[family] = train_single(
                _spec(small_corpus, tmp_path_factory.mktemp(f"ref-{family}") / "run", family))
        return cache[family]
    return get


@pytest.mark.parametrize("case", grid(CASES, DEFAULT))
def test_every_layout_the_plan_allows_matches_one_process(case, references, small_corpus,
                                                          tmp_path):
    family, layout = case
    world, parallel = LAYOUTS[layout]
    ref = references(family)
    spec = _spec(small_corpus, tmp_path / "run", family, {**parallel, "nproc": world})
    results = run_ranks(train, world, spec, timeout=240)
    got = results[0]
    got["optim"] = {k: v for r in results for k, v in r["optim"].items()}  # every stage's
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    assert got["losses"][-1] < got["losses"][0]
    assert_model_close(got["params"], ref["params"], rtol=1e-5)
    assert_model_close(got["optim"], ref["optim"], rtol=1e-5)
    if family in TIED:
        first, second = TIED[family]
        assert torch.equal(got["params"][first], got["params"][second]), "tied tensors drifted"


def test_a_model_without_a_plan_is_data_parallel_only(small_corpus, tmp_path):
    spec = _spec(small_corpus, tmp_path / "run", "bag")
    plan = describe_model(spec.model, 512, 32)
    assert not plan.supports_tp and not plan.supports_pp and plan.blocks == ""
    for parallel, needs in (({"tp": 2, "dp_shard": 1}, "tensor-parallel plan"),
                            ({"pp": 2, "dp_shard": 1}, "declares no blocks")):
        dims = ParallelDims.from_spec(spec.replace("parallel", **parallel).parallel, 2)
        with pytest.raises(SpecError, match=needs):
            check_layout(spec, dims, plan, accumulation=4)
    ac = spec.replace("memory", activation_checkpoint="full")
    with pytest.raises(SpecError, match="declares none"):
        check_layout(ac, ParallelDims.from_spec(ac.parallel, 1), plan, accumulation=4)


def test_the_built_in_gpt_declares_its_plan_and_parallel_names_none_of_its_modules():
    model = build_model(ModelSection.of(n_layers=3, d_model=32, n_heads=4, n_kv_heads=2),
                        vocab_size=64, seq_len=8, seed=0)
    plan = plan_of(model)
    assert plan.blocks == "layers" and plan.n_blocks == 3
    assert plan.tied == (("tok_embeddings.weight", "output.weight"),)
    assert plan.tp_sizes["output"] == ("output", 64)
    assert plan.tp_sizes["layers.2.feed_forward.w2"][0] == "rowwise"
    source = "\n".join(p.read_text() for p in
                       (Path(__file__).parents[2] / "src/shardwise/parallel").glob("*.py"))
    for name in ("tok_embeddings", "feed_forward", "attention_norm", ".layers", "GPT"):
        assert name not in source, f"parallel/ names the GPT's {name!r}"


def test_meta_build_gives_the_plan_without_memory():
    plan = describe_model(ModelSection.of(family=TINY, args={"width": 32, "depth": 3}), 64, 8)
    assert plan.n_blocks == 3 and plan.supports_tp and plan.supports_pp
    assert plan.shape.params > 0


def test_plan_errors_name_what_to_change(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from torch import nn\n"
        "from shardwise.models.plan import ModelPlan, ModelShape\n"
        "def build(args, vocab_size):\n"
        "    m = nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size))\n"
        "    return m, ModelPlan(shape=ModelShape(params=1), tp={'9': 'colwise'})\n")
    with pytest.raises(UserError, match="match no module"):
        describe_model(ModelSection.of(family=f"py:{bad}:build"), 64, 8)
    with pytest.raises(UserError, match="does not exist"):
        describe_model(ModelSection.of(family=f"py:{tmp_path / 'missing.py'}:build"), 64, 8)
    with pytest.raises(UserError, match="defines no function"):
        describe_model(ModelSection.of(family=f"py:{bad}:nope"), 64, 8)
    with pytest.raises(PlanError, match="unknown style"):
        ModelPlan(shape=ModelShape(params=1), tp={"x": "diagonal"})


def test_spec_checks_the_family_and_its_args():
    from shardwise.spec import load_spec, spec_to_toml
    from shardwise.spec.load import spec_from_dict

    with pytest.raises(SpecError, match=r"py:FILE\.py:FUNCTION"):
        load_spec(None, ["model.family=py:nofunction"])
    with pytest.raises(SpecError, match=r"model\.args"):
        load_spec(None, ["model.args={width = 3}"])  # the GPT takes no args
    spec = load_spec(None, [f"model.family={TINY}", "model.args={width = 16, tied = true}"])
    assert spec.model.args == {"width": 16, "tied": True}
    assert spec_from_dict(tomllib.loads(spec_to_toml(spec))).model.args == spec.model.args


def test_cli_refuses_tp_for_a_model_without_a_plan(small_corpus, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "train", "--set", f"model.family={BAG}",
         "--set", f"data.source={small_corpus}", "--set", "data.vocab_size=512",
         "--set", "parallel.tp=2", "--set", "parallel.dp_shard=1", "--nproc", "2",
         "--set", f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "tensor-parallel plan" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.grid  # 10 s; builders train in the default parity rows
def test_python_api_trains_a_builder_function_on_two_workers(small_corpus, tmp_path):
    """`shardwise.train(spec, model=build)` from a user's script: the builder is recorded as
    py:FILE:NAME, both workers import it, ZeRO-3 trains, the manifest pins the file's hash."""
    script = tmp_path / "train_mine.py"
    script.write_text(
        "import sys\n"
        "import shardwise\n"
        f"sys.path.insert(0, {str(MODELS)!r})\n"
        "from bag_lm import build\n"
        "if __name__ == '__main__':\n"
        "    run = shardwise.train(None, model=build, model_args={'width': 24}, overrides=[\n"
        f"        'data.source={small_corpus}', 'data.vocab_size=512', 'data.seq_len=32',\n"
        "        'run.steps=2', 'batch.global_batch=4', 'batch.micro_batch=2',\n"
        "        'parallel.nproc=2', 'eval.batches=1', 'sample.tokens=0',\n"
        "        'log.progress=false', 'log.tensorboard=false',\n"
        f"        'run.dir={tmp_path / 'run'}'])\n"
        "    print('RUN', run)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RUN {tmp_path / 'run'}" in proc.stdout
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    source = manifest["model"]["source"]
    assert source["family"] == f"py:{MODELS / 'bag_lm.py'}:build"
    assert source["sha256"] == hashlib.sha256((MODELS / "bag_lm.py").read_bytes()).hexdigest()
    assert manifest["topology"]["world_size"] == 2
    assert manifest["model"]["plan"]["tp"] == {}


@pytest.mark.grid  # 13 s
def test_print_plan_shows_placements_stages_units_and_tied_groups(small_corpus, tmp_path):
    def plan(*sets: str) -> subprocess.CompletedProcess:
        args = [sys.executable, "-m", "shardwise", "train", "--print-placement",
                "--set", f"data.source={small_corpus}", "--set", "data.vocab_size=512"]
        for s in sets:
            args += ["--set", s]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=tmp_path)

    proc = plan(f"model.family={TINY}", "model.args={width = 32, depth = 3, tied = true}",
                "parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "parallel.nproc=4")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "stage 0 on pp rank 0: blocks 0..1 + embed" in out
    assert "stage 1 on pp rank 1: blocks 2..2 + ln_f, head" in out
    assert "embed.weight = head.weight" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "." in line.split()[0]}
    assert rows["blocks.0.attn.q.weight"][3:5] == ["Shard(0)", "16x32"]
    assert rows["blocks.2.mlp.out.weight"][2:5] == ["1", "Shard(1)", "32x48"]
    assert rows["blocks.2.mlp.out.bias"][3] == "Replicate"
    proc = plan(f"model.family={TINY}", "model.args={width = 32, depth = 2}", "parallel.nproc=2")
    assert "FSDP units (3): blocks.0, blocks.1, (root: everything else)" in proc.stdout
    assert "Shard(0) over dp_shard=2" in proc.stdout
    bad = plan(f"model.family={TINY}", "model.args={width = 30}", "parallel.tp=4",
               "parallel.dp_shard=1", "parallel.nproc=4")
    assert bad.returncode == 2 and "does not divide" in bad.stderr, bad.stderr


def test_a_pipeline_layer_split_is_checked_against_the_model(small_corpus, tmp_path):
    spec = _spec(small_corpus, tmp_path / "run", "gpt-tied")  # 4 blocks
    plan = describe_model(spec.model, 512, 32)

    def check(split, **parallel):
        s = spec.replace("parallel", pp_layer_split=tuple(split), **parallel)
        check_layout(s, ParallelDims.from_spec(s.parallel, 2), plan, accumulation=4)

    check([3, 1], pp=2, dp_shard=1)
    for split, parallel, message in (
            ([2, 1], {"pp": 2, "dp_shard": 1}, "places 3 blocks, but the model has 4"),
            ([4], {"pp": 2, "dp_shard": 1}, "has 1 entries but there are pp x")):
        with pytest.raises(SpecError, match=message):
            check(split, **parallel)
    check([2, 2], dp_shard=2)  # like pp_schedule, unused without pipeline parallel (verify grids)
    with pytest.raises(SpecError, match="gives a stage no blocks"):
        spec.replace("parallel", pp_layer_split=(4, 0)).validate()
