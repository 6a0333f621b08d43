"""Hugging Face models (`model.family = "hf"`): the plan from HF's metadata, every layout against
world 1, ties, weights in from a local directory, export back to `from_pretrained`, refusals.

Tiny configs built here, offline (HF_HUB_OFFLINE=1); gloo, world <= 4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.models.plan import plan_of  # noqa: E402
from shardwise.models.registry import build_model  # noqa: E402
from shardwise.spec import spec_from_dict, spec_to_toml  # noqa: E402
from shardwise.spec.model import ModelSection  # noqa: E402
from tests.support.cli import shardwise  # noqa: E402
from tests.support.hf import export_round_trip  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402
from tests.support.specs import grid, tiny_spec, tiny_spec_dict  # noqa: E402
from tests.support.verify import verify_pooled  # noqa: E402
from tests.support.workers import train, train_single  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

CONFIGS = {
    "llama-tied": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "max_position_embeddings": 64, "tie_word_embeddings": True},
    "llama": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 64},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
HF = {"family": "hf", "n_layers": 4}  # n_layers is a GPT field: unused, left at its default
ROOT = Path(__file__).resolve().parents[2]


def hf_model(name: str) -> dict:
    return {"model": {"family": "hf", "hf_config": CONFIGS[name]}}


def hf_spec(corpus, run_dir, name: str, **sections):
    spec = tiny_spec_dict(corpus, run_dir, **sections)
    spec["model"] = {"family": "hf", "hf_config": CONFIGS[name]}
    return spec_from_dict(spec).validate()



# --- the adapter and the plan ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_is_bitwise_hf(name):
    """At world 1 the adapter runs HF's own modules op for op: logits bitwise equal to HF's
    forward of the same model."""
    model = build_model(ModelSection.of(family="hf", hf_config=CONFIGS[name]), 128, 32, seed=3)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    ours = model(tokens)
    theirs = model.to_hf()(input_ids=tokens).logits
    assert torch.equal(ours, theirs)
    tied = plan_of(model).tied
    assert bool(tied) == (name in ("llama-tied", "gpt2"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_build_replays_the_eager_init(name):
    """model.init = "meta" (the default): transformers' own init, recorded on the meta device and
    replayed, gives the eager build's values bit for bit."""
    from shardwise.models.deferred import materialize
    from shardwise.models.registry import build_deferred

    section = ModelSection.of(family="hf", hf_config=CONFIGS[name])
    eager = build_model(section, 128, 32, seed=5)
    model, record = build_deferred(section, 128, 32, seed=5)
    assert record.deferred and not record.fallback
    materialize([model], record, torch.device("cpu"))
    want = eager.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_plan_from_hf_metadata():
    qwen = plan_of(build_model(ModelSection.of(family="hf", hf_config=CONFIGS["qwen3"]), 128, 32,
                               seed=0, device="meta"))
    assert qwen.blocks == "model.layers" and qwen.n_blocks == 2
    assert qwen.tp["model.layers.*.self_attn.q_norm"] == "replicated"
    assert qwen.tp["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert qwen.tp["lm_head"] == "output" and qwen.tp["model.embed_tokens"] == "embedding"
    assert qwen.tp["model.layers.*.input_layernorm"] == "sequence"
    assert qwen.stages.first == ("model.embed_tokens",)
    assert qwen.stages.last == ("model.norm", "lm_head")
    gpt2 = plan_of(build_model(ModelSection.of(family="hf", hf_config=CONFIGS["gpt2"]), 128, 32,
                               seed=0, device="meta"))
    assert not gpt2.supports_tp and gpt2.supports_pp  # Conv1D: no TP plan declared
    assert gpt2.stages.first == ("transformer.wte", "transformer.wpe")
    assert gpt2.shape.layers == 2 and gpt2.shape.hidden == 64 and gpt2.shape.heads == 4


# --- layouts against world 1 ----------------------------------------------------------------
VERIFY = {
    "llama-tied": "dp1,ddp2,zero1-2,zero2-2,zero3-2,hsdp-2x2,tp2,tp2-nosp,pp2-gpipe,pp2-1f1b,"
                  "cp2,zero3-2+cp2,cp2-allgather",
    "llama": "dp1,zero3-2,tp2,pp2-1f1b",
    "qwen3": "dp1,zero3-2,hsdp-2x2,tp2,zero3-2+tp2,pp2-gpipe,pp2-1f1b,cp2,zero3-1+tp2+cp2",
    "gpt2": "dp1,ddp2,zero3-2,hsdp-2x2,pp2-gpipe,pp2-1f1b,cp2",
}


def _config(corpus, tmp_path, name: str) -> Path:
    spec = spec_from_dict(tiny_spec_dict(corpus, tmp_path / "unused", **hf_model(name)))
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec))
    return config


# AdamW's first steps move an element by about lr * sign(gradient), so an element whose gradient
# is almost zero (an unseen token's output row, say) flips with fp32 summation order and differs
# by up to 2 lr between layouts: with eps = 1e-8 that alone is a relative parameter difference of
# ~2e-5 at lr 1e-2 on these tiny HF models (freshly initialised with std 0.02). eps = 1e-5 keeps
# such elements linear in their gradient, so what is compared is the layouts' arithmetic (~1e-7),
# not that amplification; invariant mode, compared bitwise below, needs no such care.
EPS = "optimizer.eps=1e-5"


def _verify(corpus, tmp_path, name: str, layouts: str, *extra: str) -> str:
    """Through the CLI, as a user runs it."""
    proc = shardwise("verify", str(_config(corpus, tmp_path, name)), "--layouts", layouts,
                     "--steps", "3", "--out", str(tmp_path / "runs"), "--set", EPS, *extra,
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: PASS" in proc.stdout
    return proc.stdout


@pytest.mark.parametrize("name", grid(list(VERIFY), default=()))
def test_verify_layout_grid(name, small_corpus, tmp_path):
    """verify's comparison of every layout with dp1 (losses and the parameter vector within
    1e-5, the ledger exact), the layouts trained in the pooled ranks (tests/support/verify.py)."""
    rows = verify_pooled(_config(small_corpus, tmp_path, name), VERIFY[name], tmp_path / "runs",
                         EPS)
    assert [r.name for r in rows] == VERIFY[name].split(",")[1:]


@pytest.mark.grid
@pytest.mark.timeout(600)
def test_a_hugging_face_model_through_a_three_d_layout(small_corpus, tmp_path):
    """The seed's own layout at small scale on a Hugging Face model: ZeRO-1 (the distributed
    optimizer) x tp2 x pp2 at world 8, against the single process, through `shardwise verify`
    as a user runs it (the CLI row of the Hugging Face families)."""
    layout = "zero1-2+tp2+pp2-1f1b"
    out = _verify(small_corpus, tmp_path, "qwen3", f"dp1,{layout}")
    (row,) = [line for line in out.splitlines() if line.split()[:1] == [layout]]
    assert row.split()[-1] == "ok" and " exact " in row, out


@pytest.mark.grid
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_invariant_bitwise_across_data_parallel_degrees(name, small_corpus, tmp_path):
    rows = verify_pooled(_config(small_corpus, tmp_path, name), "dp1,ddp2,zero1-2,zero3-2,hsdp-2x2",
                         tmp_path / "runs", EPS, 'run.determinism="invariant"')
    assert len(rows) == 4 and all(r.bitwise for r in rows), rows


# --- ties ---------------------------------------------------------------------------------------
TIE_LAYOUTS = {"zero3-2": (2, {"dp_shard": 2}),
               "tp2": (2, {"tp": 2, "dp_shard": 1, "sequence_parallel": True}),
               "pp2": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "1f1b"})}


@pytest.mark.parametrize("layout", grid(list(TIE_LAYOUTS), default=()))
def test_ties_stay_identical_after_training(layout, small_corpus, tmp_path):
    world, parallel = TIE_LAYOUTS[layout]
    spec = hf_spec(small_corpus, tmp_path / "run", "llama-tied",
                   parallel={**parallel, "nproc": world})
    params = run_ranks(train, world, spec)[0]["params"]
    first = build_model(spec.model, 512, 32, seed=spec.run.seed)
    assert not torch.equal(params["lm_head.weight"], first.lm_head.weight)  # it trained
    assert torch.equal(params["model.embed_tokens.weight"], params["lm_head.weight"])


# --- weights in -------------------------------------------------------------------------------
def _pretrained_dir(corpus, tmp_path, name: str = "llama") -> tuple[Path, object]:
    """A save_pretrained directory of a tiny model with its own (built-in BPE) tokenizer, in
    bfloat16 as released checkpoints usually are."""
    from shardwise.data import prepare_data

    spec = tiny_spec(corpus, tmp_path / "unused")
    data = prepare_data(spec.data)
    torch.manual_seed(123)
    cfg = transformers.AutoConfig.for_model(**{**CONFIGS[name], "vocab_size": data.vocab_size})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path / "pretrained"
    model.to(torch.bfloat16).save_pretrained(str(path))
    (path / "tokenizer.json").write_bytes(Path(data.tokenizer_path).read_bytes())
    return path, data


@pytest.mark.parametrize("layout", grid(["dp1", "zero3-2", "tp2"], default=()))
def test_fine_tune_step0_loss_is_the_hf_models_own(layout, small_corpus, tmp_path):
    from shardwise.data import BatchLayout, TrainBatches

    path, _ = _pretrained_dir(small_corpus, tmp_path)
    world, parallel = {"dp1": (1, {}), "zero3-2": (2, {"dp_shard": 2}),
                       "tp2": (2, {"tp": 2, "dp_shard": 1})}[layout]
    spec_dict = tiny_spec_dict(small_corpus, tmp_path / "run", run={"steps": 1},
                               parallel={**parallel, "nproc": world})
    spec_dict["model"] = {"family": "hf", "hf_path": str(path)}
    spec = spec_from_dict(spec_dict).validate()
    result = train_single(spec) if world == 1 else run_ranks(train, world, spec)[0]

    from shardwise.data import prepare_data
    from shardwise.run.preflight import with_model_tokenizer

    data = prepare_data(with_model_tokenizer(spec).data)  # the model's own tokenizer.json
    assert data.tokenizer_path == path / "tokenizer.json"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    batches, _ = TrainBatches(data.split("train", 32), spec.run.seed,
                              BatchLayout.checked(8, 2, 1), 0, torch.device("cpu")).next_step()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in batches:
            logits = hf(input_ids=inputs).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                       reduction="sum").item()
            count += targets.numel()
    assert result["losses"][0] == pytest.approx(total / count, rel=1e-6)


# --- weights out -------------------------------------------------------------------------------
@pytest.mark.grid
def test_export_round_trip_from_zero3_tp2(small_corpus, tmp_path):
    """Trained at ZeRO-3 x TP2 (world 4), exported with `shardwise export --format hf`:
    from_pretrained gives logits identical to the trained model's."""

    run_dir = tmp_path / "run"
    spec = hf_spec(small_corpus, run_dir, "qwen3", checkpoint={"enabled": True},
                   parallel={"nproc": 4, "dp_shard": 2, "tp": 2})
    params = run_ranks(train, 4, spec)[0]["params"]
    out = tmp_path / "export"
    export_round_trip(run_dir, spec, params, out)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()



@pytest.mark.grid
def test_export_tied_writes_one_tensor(small_corpus, tmp_path):
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    spec = hf_spec(small_corpus, run_dir, "llama-tied", checkpoint={"enabled": True},
                   run={"steps": 2})
    params = train_single(spec)["params"]
    out = tmp_path / "export"
    proc = shardwise("export", str(run_dir), "--format", "hf", "--out", str(out),
                     "--dtype", "bfloat16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, params["lm_head.weight"].bfloat16().float())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


# --- refusals ---------------------------------------------------------------------------------
def _train_refused(tmp_path, corpus, *sets: str) -> str:
    spec = spec_from_dict(tiny_spec_dict(corpus, tmp_path / "run", **hf_model("llama")))
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec))
    proc = shardwise("train", str(config), *[a for s in sets for a in ("--set", s)],
                     cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return " ".join(proc.stderr.split())


REFUSALS = {
    "hub id": (['model.hf_config=""', 'model.hf_path="meta-llama/Llama-3.2-1B"'],
               "never downloads"),
    "no directory": (['model.hf_config=""', 'model.hf_path="no/such/dir/here"'],
                     "is not a directory"),
    "both sources": (['model.hf_path="x"'], "exactly one of"),
    "no model_type": (['model.hf_config={hidden_size = 64}'], "model_type"),
    "unknown style": (['model.hf_tp_plan={"model.layers.*.mlp.up_proj" = "colwise_magic"}',
                       "parallel.tp=2", "parallel.dp_shard=1", "parallel.nproc=2"],
                      "does not translate"),
    "pattern matches nothing": (['model.hf_tp_plan={"model.blocks.*.fc" = "colwise"}',
                                 "parallel.tp=2", "parallel.dp_shard=1", "parallel.nproc=2"],
                                "match no module"),
    "tp does not divide heads": (["parallel.tp=3", "parallel.dp_shard=1", "parallel.nproc=3"],
                                 "heads"),
    "seq_len beyond positions": (["data.seq_len=128"], "positions"),
    "gpt2 has no tp plan": (['model.hf_config={model_type = "gpt2", n_embd = 64, n_layer = 2, '
                             'n_head = 4}', "parallel.tp=2", "parallel.dp_shard=1",
                             "parallel.nproc=2"], "hf_tp_plan"),
    "hf field on gpt": (['model.family="gpt"'], "belongs to model.family = 'hf'"),
    "cp with attention dropout": (['model.hf_config={model_type = "gpt2", n_embd = 64, '
                                   'n_layer = 2, n_head = 4, attn_pdrop = 0.1}', "parallel.cp=2",
                                   "parallel.dp_shard=1", "parallel.nproc=2"],
                                  "attn_pdrop = 0.1"),
}


@pytest.mark.grid  # 8 s, a CLI run
def test_a_tp_plan_shardwise_cannot_translate_matters_only_for_tp(small_corpus, tmp_path):
    """A declared plan with a style shardwise does not translate (OLMoE declares
    colwise_gather_output on q_proj) leaves every layout without tp open: one step trains."""
    spec = spec_from_dict(tiny_spec_dict(small_corpus, tmp_path / "run", **hf_model("llama"),
                                         run={"steps": 1}))
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec))
    proc = shardwise("train", str(config), "--set",
                     'model.hf_tp_plan={"model.layers.*.self_attn.q_proj" = "colwise_magic"}',
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("case", grid(list(REFUSALS), default=("hub id",)))
def test_refusals_exit_2_with_a_message(case, small_corpus, tmp_path):
    sets, needle = REFUSALS[case]
    assert needle in _train_refused(tmp_path, small_corpus, *sets)


@pytest.mark.grid  # 7 s, a CLI run
def test_weights_that_are_not_the_models_are_refused(small_corpus, tmp_path):
    path, _ = _pretrained_dir(small_corpus, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights no longer fit the config
    (path / "config.json").write_text(json.dumps(config))
    message = _train_refused(tmp_path, small_corpus, 'model.hf_config=""',
                             f'model.hf_path="{path}"')
    assert "shapes differ" in message and "mlp" in message


@pytest.mark.grid
def test_train_exports_at_the_end(small_corpus, tmp_path):
    """checkpoint.hf_export through `shardwise train`: the final model as a from_pretrained
    directory inside the run directory, equal to the final checkpoint."""
    spec = hf_spec(small_corpus, tmp_path / "run", "gpt2", checkpoint={"enabled": True},
                   parallel={"nproc": 2, "pp": 2, "dp_shard": 1})
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec).replace('hf_export = ""', 'hf_export = "hf"'))
    proc = shardwise("train", str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "exported step-000005" in proc.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "hf"))
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
