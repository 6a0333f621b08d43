"""Hugging Face sparse-MoE models (Qwen3-MoE) under shardwise's expert contract: bitwise HF's
forward at world 1, HF's load-balancing loss, expert parallel through `shardwise verify`, export
back to `from_pretrained` from an ep2 run, expert telemetry, refusals.

Tiny configs built here, offline (HF_HUB_OFFLINE=1); gloo, world <= 4.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardwise.models.aux_loss import aux_loss_scale  # noqa: E402
from shardwise.models.plan import TP_STYLES, plan_of  # noqa: E402
from shardwise.models.registry import build_model  # noqa: E402
from shardwise.spec import spec_from_dict, spec_to_toml  # noqa: E402
from shardwise.spec.model import ModelSection  # noqa: E402
from tests.support.cli import shardwise  # noqa: E402
from tests.support.compare import assert_params_close  # noqa: E402
from tests.support.hf import export_round_trip  # noqa: E402
from tests.support.ranks import run_ranks  # noqa: E402
from tests.support.specs import grid, tiny_spec_dict  # noqa: E402
from tests.support.verify import verify_pooled  # noqa: E402
from tests.support.workers import train, train_single  # noqa: E402

os.environ["HF_HUB_OFFLINE"] = "1"

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64,
             "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
             "max_position_embeddings": 64, "output_router_logits": True,
             "router_aux_loss_coef": 0.01}


def _section(**config) -> ModelSection:
    return ModelSection.of(family="hf", hf_config={**QWEN3_MOE, **config})


def _raw_hf(model) -> torch.nn.Module:
    """A plain transformers model (HF's own classes and forward) with `model`'s weights."""
    raw = transformers.AutoModelForCausalLM.from_config(model.hf_config)
    raw.load_state_dict(model.state_dict())
    return raw


def _spec(corpus, run_dir, config: dict | None = None, **sections):
    spec = tiny_spec_dict(corpus, run_dir, **sections)
    spec["model"] = {"family": "hf", "hf_config": {**QWEN3_MOE, **(config or {})}}
    return spec_from_dict(spec).validate()


# --- world 1: HF's own numbers --------------------------------------------------------------
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("top_k", [2, 3])
def test_forward_is_bitwise_raw_hf(implementation, top_k):
    """The adapted model (routing, sort by expert, experts on contiguous groups, unsort) gives
    the raw HF model's logits bit for bit, for both of HF's ways of combining the k experts
    (grouped: a sum over the slots; eager: index_add_ in expert order)."""
    model = build_model(_section(num_experts_per_tok=top_k), 128, 32, seed=3)
    raw = _raw_hf(model)
    raw.config._experts_implementation = implementation
    model.hf_config._experts_implementation = implementation
    assert sorted(model.state_dict()) == sorted(raw.state_dict())  # HF's names, unchanged
    for seed, batch in ((0, 2), (1, 7)):  # (7: uneven groups, the rows' order within them matters)
        tokens = torch.randint(0, 128, (batch, 32), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.equal(model(tokens), raw(input_ids=tokens).logits)


def test_mixtral_is_adapted_too():
    """Detection is by the parameters' shapes, not the model's name: Mixtral's blocks (its own
    router, `num_local_experts`) take the same contract, bitwise HF's forward."""
    config = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 16,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    model = build_model(ModelSection.of(family="hf", hf_config=config), 128, 32, seed=3)
    assert plan_of(model).experts == "model.layers.*.mlp.experts"
    tokens = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), _raw_hf(model)(input_ids=tokens).logits)


def test_plan_names_the_experts():
    model = build_model(_section(), 128, 32, seed=0, device="meta")
    plan = plan_of(model)
    assert plan.experts == "model.layers.*.mlp.experts"
    assert plan.shape.experts == 4 and plan.shape.ffn == 16 and plan.shape.top_k == 2
    # the experts are not split by tensor parallel: the block is whole on every tp rank (where
    # shardwise has the `tokens` style), HF's packed expert styles are left out
    assert {p: s for p, s in plan.tp.items() if ".mlp" in p} in (
        {}, {"model.layers.*.mlp": "tokens"})
    # active weights per layer: attention (q, k, v, o) + router + top-2 SwiGLU experts
    h, head, kv, i = 32, 8, 2, 16
    attention = 2 * h * 4 * head + 2 * h * kv * head
    assert plan.flop_counts.layer_matmul_params == attention + 4 * h + 2 * 3 * h * i


def test_aux_loss_is_hfs_load_balancing_loss():
    """One MoE layer, one micro-batch: the gradient the balancing term gives the router is that
    of router_aux_loss_coef x HF's load_balancing_loss_func, and the reported figure (Switch,
    1 = balanced) is HF's aux_loss / top_k."""
    model = build_model(_section(num_hidden_layers=1, router_aux_loss_coef=0.1), 128, 32, seed=3)
    raw = _raw_hf(model)
    model.train()
    raw.train()
    tokens = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with aux_loss_scale(1.0 / tokens.numel()):  # the objective's 1 / targets
        (model(tokens) * 0).sum().backward()
    out = raw(input_ids=tokens, output_router_logits=True)
    (0.1 * out.aux_loss + 0 * out.logits.sum()).backward()
    ours = model.model.layers[0].mlp.gate.weight.grad
    theirs = raw.model.layers[0].mlp.gate.weight.grad
    assert theirs.norm() > 0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-9)
    stats = model.model.layers[0].mlp.step_stats
    assert (stats[1] / stats[2]).item() * 2 == pytest.approx(out.aux_loss.item(), rel=1e-6)


# --- layouts against world 1 ----------------------------------------------------------------
VERIFY = {
    "ep": "dp1,ep2+zero3-2",
    "data-parallel": "dp1,ddp2,zero3-2,ep2",
    "pipeline": "dp1,pp2-1f1b,pp2-gpipe",
    "context": "dp1,cp2,zero3-2+cp2,cp2+ep2",  # balancing fractions summed over the cp ranks
    "pipeline+ep": "dp1,zero2-2+pp2-1f1b+ep2,zero3-2+pp2-gpipe+ep2",
    "tensor": "dp1,tp2,tp2-nosp",  # the MoE blocks whole on every tp rank (the `tokens` style)
    "world-4": "dp1,ep4,ep2+ddp4,ep2+hsdp-2x2",
}


CLI_ROW = "ep"  # through `shardwise verify` as a user runs it; the others in the pooled ranks


@pytest.mark.parametrize("name", grid(list(VERIFY), default=()))
def test_verify_expert_parallel(name, small_corpus, tmp_path):
    """verify's comparison (parameters after 3 steps of every layout against dp1, rtol 1e-5, the
    ledger exact), and a tighter bound on the relative parameter difference than verify's own.
    One row runs the CLI; the rest train in the pooled ranks (tests/support/verify.py)."""
    if name == "tensor" and "tokens" not in TP_STYLES:
        pytest.skip("this shardwise has no `tokens` tensor-parallel style: tp with experts is "
                    "refused")
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(_spec(small_corpus, tmp_path / "unused")))
    layouts = VERIFY[name].split(",")[1:]
    if name != CLI_ROW:
        rows = verify_pooled(config, VERIFY[name], tmp_path / "runs", "optimizer.eps=1e-5")
        assert [r.name for r in rows] == layouts
        assert all(r.rel_dparam < 1e-6 for r in rows), rows  # (measured: ~1e-7)
        return
    proc = shardwise("verify", str(config), "--layouts", VERIFY[name], "--steps", "3",
                     "--out", str(tmp_path / "runs"), "--set", "optimizer.eps=1e-5",
                     cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: PASS" in proc.stdout
    table = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
             if line.split()[:1] and line.split()[0] in layouts}
    assert sorted(table) == sorted(layouts), proc.stdout
    for row in table.values():
        assert float(row[3]) < 1e-6, proc.stdout  # ‖Δparam‖/‖p‖ (measured: ~1e-7)


# --- weights out, telemetry -------------------------------------------------------------------
def _moe_steps(run_dir: Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e.get("kind", e.get("event")) == "step"]


@pytest.mark.grid  # 9 s; export round trips run in e2e/test_export.py
def test_export_round_trip_from_ep2(small_corpus, tmp_path):
    """Trained at ep2 (over DDP, world 2; `verify` above covers ep2 over ZeRO-3): parameters
    and expert telemetry as the single process's; `shardwise export --format hf` then
    from_pretrained gives the trained weights and bitwise the trained model's logits."""

    ref = train_single(_spec(small_corpus, tmp_path / "ref"))
    run_dir = tmp_path / "run"
    spec = _spec(small_corpus, run_dir, checkpoint={"enabled": True},
                 parallel={"nproc": 2, "dp_replicate": 2, "dp_shard": 1, "ep": 2})
    params = run_ranks(train, 2, spec)[0]["params"]
    assert_params_close(params, ref["params"], rtol=1e-5)
    first = build_model(spec.model, 512, 32, seed=spec.run.seed)
    assert not torch.equal(params["model.layers.0.mlp.experts.gate_up_proj"],
                           first.model.layers[0].mlp.experts.gate_up_proj)  # it trained
    got, want = _moe_steps(run_dir), _moe_steps(tmp_path / "ref")
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        assert g["moe_load_mean"] == 8 * 32 * 2 / 4  # tokens x k / experts, per layer
        for key in ("moe_load_min", "moe_load_max", "moe_load_cv", "moe_aux_loss"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
        assert g["moe_aux_loss"] >= 1.0 and g["moe_load_cv"] > 0
    loaded = export_round_trip(run_dir, spec, params, tmp_path / "export")
    assert type(loaded.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"  # HF's own


# --- refusals ---------------------------------------------------------------------------------
QWEN2_MOE = ('{ model_type = "qwen2_moe", hidden_size = 32, intermediate_size = 64, '
             'moe_intermediate_size = 16, shared_expert_intermediate_size = 16, '
             'num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, '
             'num_experts = 4, num_experts_per_tok = 2 }')
MIXTRAL = ('{ model_type = "mixtral", hidden_size = 32, intermediate_size = 16, '
           'num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, '
           'num_local_experts = 4, num_experts_per_tok = 2, router_jitter_noise = 0.1 }')
REFUSALS = {
    "ep does not divide experts": (["parallel.nproc=3", "parallel.dp_shard=3", "parallel.ep=3",
                                    "batch.global_batch=12"],
                                   "does not divide the model's 4 experts"),
    # (ep with tp runs over ZeRO-2/3; under DDP there the optimizers reduce: not with ep yet)
    "ep with tp under ddp": (["parallel.nproc=4", "parallel.dp_replicate=2", "parallel.dp_shard=1",
                              "parallel.zero=0", "parallel.tp=2", "parallel.ep=2"],
                             "with ep = 2 under tp = 2"),
    "invariant": (['run.determinism="invariant"'], "does not cover them"),
    "shared expert": ([f"model.hf_config={QWEN2_MOE}"], "shared expert"),
    "router jitter": ([f"model.hf_config={MIXTRAL}"], "router_jitter_noise = 0.1"),
}


@pytest.mark.parametrize("case", grid(list(REFUSALS), default=()))
def test_refusals_exit_2_with_a_message(case, small_corpus, tmp_path):
    sets, needle = REFUSALS[case]
    spec = _spec(small_corpus, tmp_path / "run")
    config = tmp_path / "spec.toml"
    config.write_text(spec_to_toml(spec))
    proc = shardwise("train", str(config), *[a for s in sets for a in ("--set", s)],
                     cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in " ".join(proc.stderr.split())
