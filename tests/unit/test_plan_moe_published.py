"""The planner against published mixture-of-experts runs (benchmarks/published_moe.toml): a
reference set states MoE models (routed, shared and dense-leading blocks; multi-head latent
attention) and expert-parallel layouts, each checked when loaded; the rows are scored out of
sample with the fit on the dense rows; an MoE model's interval comes from them; and expert
parallel under a sharded optimizer reduces the experts' gradients on the expert-data-parallel
group, not on all of data parallel."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from shardwise.planner import accuracy, comm, published, published_report, validate
from shardwise.planner.bubble import rank_groups
from shardwise.planner.cluster import resolve_cluster
from shardwise.planner.cost import (
    DEFAULT_PARAMS,
    chip_for,
    predict,
    predict_memory,
)
from shardwise.planner.dispatch import distinct_groups, token_copies
from shardwise.planner.dpcomm import dp_comm
from shardwise.planner.fitted import MOE_RATIOS
from shardwise.planner.kernels import block_times, linear_times
from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import layer_activation, rank_params, state_lower_bound
from shardwise.planner.models import mla_attention, preset
from shardwise.planner.params import BlockSaves, CostParams
from shardwise.planner.published_report import fitted_module
from tests.support.reference_sets import refusal

MOE = Path(__file__).resolve().parents[2] / "benchmarks" / "published_moe.toml"


@pytest.fixture(scope="module")
def rows() -> list[published.Reference]:
    return published.load(MOE)


def test_moe_models_load_with_their_experts_and_latent_attention(rows) -> None:
    by = {r.model.name: r.model for r in rows}
    oss = by["gpt-oss-120b"]
    assert (oss.experts, oss.top_k, oss.expert_ffn, oss.dense_layers, oss.ffn) == (128, 4, 2880, 0, 0)
    # its model card: 116.83 B, 5.13 B active without the input embedding (biases and sinks are
    # the 0.04 B the planner leaves out)
    assert oss.params == pytest.approx(116.83e9, rel=0.001)
    assert oss.active_params - 201088 * 2880 == pytest.approx(5.13e9, rel=0.001)
    # DeepSeek-V3 from the file is the preset built in, weights and all
    ds = by["deepseek-v3"]
    built_in = preset("deepseek-v3")
    assert ds.params == built_in.params and ds.active_params == built_in.active_params
    assert (ds.attn_params, ds.hd) == mla_attention(7168, 128, 1536, 512, 128, 64, 128)
    assert ds.layer_kinds[:4] == ("dense", "dense", "dense", "moe")
    kimi = by["kimi-k2"]
    assert kimi.params == pytest.approx(1.0e12, rel=0.03)  # its model card: 1 T, 32 B activated
    assert kimi.active_params == pytest.approx(32e9, rel=0.03)


def test_every_published_moe_layout_is_predicted_to_fit(rows) -> None:
    """They ran. AutoModel's rows fit once its precision is stated: the whole model in bf16
    (parameters, gradients, Adam's moments; no fp32 master), experts outside FSDP where
    expert parallel covers data parallel."""
    for r in rows:
        mem, _ = predict_memory(r.candidates[0], r.model, r.batch, r.params(CostParams()),
                                r.cluster.cluster.device)
        assert mem.total <= r.cluster.memory_bytes, (r.id, mem.total / 2**30)


def test_megatrons_moe_block_keeps_what_its_module_recompute_leaves(rows) -> None:
    """GPT-OSS's block as Megatron-Core runs it for the published rows (bf16, fused attention,
    recompute_modules ["layernorm", "moe_act"], the router's weights inside the activation),
    counted by hand per token: the two norms' inputs, Q/K/V, the attention output and its fp32
    log-sum-exp, the routed tokens (top-4 copies), the first experts GEMM's gated output, the
    router's fp32 logits and probabilities. Each saving is the tensor it leaves unsaved."""
    oss = next(r for r in rows if r.model.name == "gpt-oss-120b")
    model, params = oss.model, oss.params(CostParams())
    assert (params.recompute_norms, params.recompute_moe_act,
            params.moe_weights_at_combine, params.logits_bytes) == (True, True, False, 6)
    h, k, ffn, tokens = 2880, 4, 2880, 4 * 4096
    by_hand = (2 * 2 * h + 2 * (64 + 2 * 8) * 64 + 2 * 64 * 64 + 4 * 64 + 2 * k * h
               + 2 * k * 2 * ffn + 8 * 128)
    saves = BlockSaves.of(params)
    megatron = layer_activation(model, "moe", tokens, 4096, 1, False, 2, 2, True, False, False,
                                saves)
    assert megatron == pytest.approx(tokens * by_hand)
    textbook = layer_activation(model, "moe", tokens, 4096, 1, False, 2, 2, True, False)
    assert textbook - megatron == pytest.approx(tokens * (2 * 2 * h + 2 * k * ffn + 2 * k * h))


def test_module_recompute_redoes_its_forward_in_backward() -> None:
    """What the block does not save, its backward recomputes: each norm's forward and the routed
    activation's, as HBM bytes on top of the backward's own; the forward is unchanged."""
    model = preset("deepseek-v3")
    chip = chip_for(resolve_cluster("dgx-h100", nodes=1), Batch(8, 4096), DEFAULT_PARAMS)
    keep = block_times(model, "moe", 1, 4096, 1, 1, False, 2, 2, True, False, False, chip, 8)
    redo = block_times(model, "moe", 1, 4096, 1, 1, False, 2, 2, True, False, False, chip, 8,
                       False, BlockSaves(norms=False, moe_act=False))
    assert redo.forward == keep.forward and redo.backward.gemm == keep.backward.gemm
    extra = 4096 * (2 * (2 + 2) * 7168 + 3 * 2 * 8 * 2048)
    assert redo.backward.memory - keep.backward.memory == pytest.approx(
        extra / chip.hbm, rel=1e-6)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("ep", [8, 2])
def test_state_in_the_compute_dtype_holds_two_bytes_an_element(zero, ep) -> None:
    """With `state_in_compute_dtype` a parameter, its gradient (grad_bytes 2) and each AdamW
    moment take 2 bytes under bf16 (shardwise's fp32 parameters and moments: 4 each; no master
    either way). Experts that expert parallel alone spreads (ep = dp) get no FSDP copy. The
    search's lower bound stays below every prediction."""
    model = preset("deepseek-v3")
    batch = Batch(1024, 4096)
    fp32 = CostParams()
    low = dataclasses.replace(fp32, state_in_compute_dtype=True, grad_bytes=2)
    lo = Layout(dp_shard=8, ep=ep, pp=1, zero=zero, micro_batch=1)
    a, _ = predict_memory(lo, model, batch, fp32)
    b, _ = predict_memory(lo, model, batch, low)
    assert b.params == pytest.approx(a.params / 2)
    assert b.optimizer == pytest.approx(a.optimizer / (3 if zero == 1 else 2))  # 4 of 12 / 8
    assert b.grads == pytest.approx(a.grads / 2)
    if zero >= 2:
        held = rank_params(model, rank_groups(model, 1, 1, "none", 4096, "none", 1, False)[1][0],
                           1, ep).experts
        saved = a.gathered_params - b.gathered_params
        assert saved > 0 if ep == 8 and zero == 2 else saved >= 0
        if ep == 8 and zero == 2:  # the experts' bf16 copy and fp32 non-matmul gathers
            assert saved >= 2 * held
    for params, mem in ((fp32, a), (low, b)):
        assert state_lower_bound(model, lo, batch, params) <= mem.total


def test_every_moe_row_is_expert_parallel_inside_data_parallel(rows) -> None:
    for r in rows:
        (lo,) = r.candidates
        assert lo.ep > 1 and (lo.dp_shard * lo.cp) % lo.ep == 0 and lo.zero >= 1, r.id
        assert r.model.experts % lo.ep == 0


def test_the_moe_rows_are_scored_out_of_sample_by_the_shipped_fit(rows) -> None:
    """planner/fitted.py's MOE_RATIOS are these rows predicted with the fitted (dense-only)
    parameters: regenerated with the fit, never fitted on."""
    results = validate.predict_all(rows, DEFAULT_PARAMS)
    assert tuple(round(r.ratio, 4) for r in results) == MOE_RATIOS
    assert len(MOE_RATIOS) == len(rows) >= 5


def test_an_moe_models_interval_comes_from_the_moe_rows() -> None:
    dense = accuracy.interval("hopper")
    moe = accuracy.interval("hopper", moe=True)
    assert dense is not None and moe is not None
    assert moe.basis == "moe" and moe.runs == len(MOE_RATIOS)
    assert (moe.low, moe.high) == tuple(accuracy.quantiles(MOE_RATIOS, (0.1, 0.9)))
    assert (moe.low, moe.high) != (dense.low, dense.high)
    assert "MoE runs held out" in accuracy.describe(0.30, moe)
    assert "published_moe.toml" in moe.drawn_from() and "without its source" in dense.drawn_from()
    assert accuracy.interval("", moe=True) is None


def test_the_moe_bands_generations_are_the_moe_files(rows) -> None:
    """The MoE band says when a device's generation has no published MoE run: it knows which
    generations the file's rows ran on (`accuracy.MOE_GENERATIONS`), held to the file here."""
    assert set(accuracy.MOE_GENERATIONS) == {r.cluster.device.generation for r in rows}
    ampere = accuracy.interval("ampere", moe=True)
    assert ampere is not None and ampere.unseen == "ampere"
    assert "none on ampere" in ampere.drawn_from()
    for seen in ("hopper", "blackwell"):  # Megatron-Bridge's GPT-OSS rows on DGX-B200
        assert accuracy.interval(seen, moe=True).unseen == ""  # type: ignore[union-attr]


def test_the_generated_module_carries_the_moe_ratios(rows, tmp_path) -> None:
    class _V:  # the parts of a Validation fitted_module reads
        path = MOE
        fitted = DEFAULT_PARAMS
        held_out = in_sample = validate.predict_all(rows[:1], DEFAULT_PARAMS)

    results = validate.predict_all(rows, DEFAULT_PARAMS)
    text = fitted_module(_V, "stamp", results, MOE)  # type: ignore[arg-type]
    namespace: dict = {}
    exec(compile(text, "fitted.py", "exec"), namespace)
    assert namespace["MOE_RATIOS"] == tuple(round(r.ratio, 4) for r in results)
    assert "published_moe.toml (sha256 " in text
    empty: dict = {}
    exec(compile(fitted_module(_V, "stamp"), "fitted.py", "exec"), empty)  # type: ignore[arg-type]
    assert empty["MOE_RATIOS"] == ()


def test_expert_gradients_reduce_on_the_expert_data_parallel_group() -> None:
    """Megatron's distributed optimizer with ep 8 inside dp 16: the dense gradients are
    reduce-scattered over the 16 data-parallel ranks, the experts' over the 2 that hold the same
    experts (the bytes each rank sends: (n-1)/n of what it reduces)."""
    model = published.load(MOE)[0].model
    cluster = resolve_cluster("dgx-h100", nodes=8)
    params = CostParams(low_precision_params=True, grad_bytes=4)
    lo = Layout(dp_shard=16, zero=1, ep=8, pp=4, schedule="1f1b")
    _, loads, _ = rank_groups(model, 4, 1, "1f1b", 4096, "none", 2, False)
    load = loads[0]
    rp = rank_params(model, load, 1, 8)
    dense, experts = rp.linear + rp.other, rp.experts
    got = dp_comm(model, load, lo, 80, "bf16", cluster, params)
    reduce = 15 / 16 * 4 * dense + 1 / 2 * 4 * experts
    gather = 15 / 16 * 2 * dense + 1 / 2 * 2 * experts
    assert got.bytes_shard == pytest.approx(reduce + gather)
    assert got.shard_params == pytest.approx(dense / 16 + experts / 2)
    # without expert parallel every gradient is reduced over all of data parallel
    flat = dp_comm(model, load, Layout(dp_shard=16, zero=1, pp=4, schedule="1f1b"), 80, "bf16",
                   cluster, params)
    rp1 = rank_params(model, load, 1, 1)
    assert flat.bytes_shard == pytest.approx(15 / 16 * 6 * rp1.total)


@pytest.mark.parametrize("old, new, words", [
    ("experts = 128\ntop_k = 4\nexpert_ffn = 2880", "experts = 128\ntop_k = 4",
     ["[models.gpt-oss-120b]", "experts, top_k and expert_ffn", "expert_ffn missing"]),
    ("experts = 128\ntop_k = 4", "experts = 4\ntop_k = 8", ["top_k = 8 is more than the 4"]),
    ("dense_layers = 1", "dense_layers = 61", ["dense_layers = 61 leaves no MoE block"]),
    ("expert_ffn = 2880", "expert_ffn = 2880\nffn = 11520",
     ["[models.gpt-oss-120b]", "ffn = 11520 has no block to apply to", "Remove ffn",
      "moe_every"]),
    ("dense_layers = 3", "dense_layers = -1", ["dense_layers = -1 must be a whole number"]),
    ("expert_ffn = 2880", "expert_ffn = 2880\nmoe_every = 0",
     ["[models.gpt-oss-120b]", "moe_every = 0 must be a whole number of at least 1"]),
    ("expert_ffn = 2880", "expert_ffn = 2880\nmoe_every = 2",
     ["[models.gpt-oss-120b] does not set ffn"]),
    ("expert_ffn = 2880", "expert_ffn = 2880\nmoe_every = 37\nffn = 2880",
     ["moe_every = 37 leaves no MoE block of the 36"]),
    ("v_head_dim = 128\nexperts = 256", "experts = 256",
     ["[models.deepseek-v3]", "latent attention needs v_head_dim"]),
    ("q_lora_rank = 1536\nkv_lora_rank = 512\nqk_nope_head_dim = 128\nqk_rope_head_dim = 64\n"
     "v_head_dim = 128\nexperts = 384", "kv_heads = 8\nq_lora_rank = 1536\nkv_lora_rank = 512\n"
     "qk_nope_head_dim = 128\nqk_rope_head_dim = 64\nv_head_dim = 128\nexperts = 384",
     ["kv_heads / head_dim do not apply to multi-head latent attention"]),
    ("dp = 16, ep = 8, zero = 1", "dp = 16, ep = 32, zero = 1",
     ["gpt-oss-120b-64gpu-26.02", "layout.ep = 32 does not divide dp·cp = 16",
      "expert tensor parallel != tp"]),
    ("dp = 16, ep = 8, zero = 1", "dp = 16, ep = 3, zero = 1",
     ["layout.ep = 3 does not divide the 128 experts"]),
    ("dp = 16, ep = 8, zero = 1", "dp = 16, ep = 8, zero = 0",
     ["layout.ep = 8 with zero = 0", "sharded optimizer"]),
    ("dp = 16, ep = 8, zero = 1", 'dp = 16, ep = "eight", zero = 1',
     ["layout.ep = 'eight' must be a whole number"]),
    ("experts = 128\ntop_k = 4\nexpert_ffn = 2880\n", "ffn = 11520\n",
     ["layout.ep = 8 for gpt-oss-120b, which has no experts"]),
    ("stack = { pipeline_local_batch = 8 }\nmeasured = { kind = \"tokens_per_s_per_gpu\", "
     "value = 924.0 }", "stack = { pipeline_local_batch = -8 }\nmeasured = { kind = "
     "\"tokens_per_s_per_gpu\", value = 924.0 }",
     ["kimi-k2-256gpu", "stack.pipeline_local_batch = -8", "sequences per data-parallel rank"]),
    ("micro_batch = 4, recompute = \"full\"", "micro_batch = 4, recompute = \"op\"",
     ["qwen3-30b-a3b-8gpu", "recompute \"op\"", "dense blocks", "none, selective, full"])])
def test_a_malformed_moe_row_is_named_field_by_field(tmp_path, old, new, words) -> None:
    message = refusal(MOE, old, new, tmp_path)
    for word in words:
        assert word in message, (word, message)


def test_out_of_sample_rows_are_predicted_with_the_parameters_given(rows) -> None:
    slow = CostParams(gemm_efficiency_hopper=0.3)
    a = published_report.out_of_sample(MOE, DEFAULT_PARAMS)
    b = published_report.out_of_sample(MOE, slow)
    assert [r.ref.id for r in a] == [r.id for r in rows]
    assert all(x.predicted_mfu > y.predicted_mfu for x, y in zip(a, b, strict=True))


def test_a_deduplicating_dispatcher_sends_a_token_once_per_rank_and_node() -> None:
    """All-to-all sends top_k copies; DeepEP's kernels one per destination rank and one per
    destination node across nodes. Independent top-k choices over E experts in G equal blocks
    touch G(1 - C(E - E/G, k)/C(E, k)) blocks; AutoModel's forced-balanced gate gives a token k
    consecutive experts, one or two ranks."""
    assert token_copies(256, 8, 64, 8, "all_to_all", "uniform") == (8.0, 8.0)
    ranks, nodes = token_copies(256, 8, 64, 8, "deduplicated", "uniform")
    assert ranks == pytest.approx(64 * (1 - math.comb(252, 8) / math.comb(256, 8)))
    assert nodes == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert 7 < ranks < 8 and 5 < nodes < 5.5
    # consecutive: 8 experts from a multiple of 8, 4 a rank -> 2 ranks, 32 a node -> 1 node
    assert token_copies(256, 8, 64, 8, "deduplicated", "consecutive") == (2.0, 1.0)
    # 3 experts from a multiple of 3 over blocks of 4: spans 1 or 2 blocks, 1.5 on average
    assert distinct_groups(12, 3, 3, "consecutive") == pytest.approx(1.5)
    assert distinct_groups(256, 8, 1, "uniform") == 1.0


def test_dedup_cuts_the_network_share_of_expert_parallel() -> None:
    """The same layout over 8 nodes: the deduplicated dispatch moves fewer bytes across nodes
    than the plain all-to-all, and fewer still when a token's experts are adjacent; the plain
    all-to-all's network share is the members' share on other nodes, as before the dispatcher
    existed."""
    model = preset("deepseek-v3")
    cluster = resolve_cluster("dgx-h100", nodes=32)
    lo = Layout(dp_shard=64, zero=2, ep=64, pp=4, v=8, schedule="interleaved-1f1b")
    batch = Batch(512, 4096)
    plain = predict(lo, model, cluster, batch, CostParams())
    dedup = predict(lo, model, cluster, batch, CostParams(ep_dispatch="deduplicated"))
    local = predict(lo, model, cluster, batch, CostParams(ep_dispatch="deduplicated",
                                                          ep_routing="consecutive"))
    assert plain.breakdown["ep"] > dedup.breakdown["ep"] > local.breakdown["ep"] > 0
    # all_to_all's network bytes: (N-1)/N of the top_k copies, as before the dispatcher existed
    token = 2 * 4096 * model.hidden
    grp_nodes = 8
    assert comm.all_to_all(8 * token, plain_group(cluster, lo)) == pytest.approx(
        comm.all_to_all(8 * token, plain_group(cluster, lo), 8 * token * (grp_nodes - 1) / grp_nodes))


def plain_group(cluster, lo):
    groups, _ = comm.mesh_groups(lo.tp, lo.cp, lo.dp_shard, lo.dp_replicate, lo.pp, lo.ep,
                                 lo.order, cluster, 0.85, 8.4e-6)
    return groups["ep"]


def test_latent_attentions_projections_cost_its_own_weights() -> None:
    """MLA's projections (187 M weights a block for DeepSeek-V3) are timed as GEMMs of those
    weights, not of the MHA it is approximated by for the attention core (587 M)."""
    model = preset("deepseek-v3")
    chip = chip_for(resolve_cluster("dgx-h100", nodes=1), Batch(8, 4096),
                    CostParams())
    assert chip is not None
    mla = block_times(model, "dense", 1, 4096, 1, 1, False, 2, 2, True, False, False, chip)
    mha = block_times(dataclasses.replace(model, attn_params=0), "dense", 1, 4096, 1, 1, False,
                      2, 2, True, False, False, chip)
    mha_weights = 4 * model.hidden * model.heads * model.hd
    saved = (mha_weights - model.attn_params) * 2 * 4096 * 3  # forward + two backward GEMMs
    spent = (mha.forward.gemm + mha.backward.gemm) - (mla.forward.gemm + mla.backward.gemm)
    assert spent > 0
    assert spent * chip.peak == pytest.approx(saved / chip.gemm, rel=0.25)


@pytest.mark.parametrize("tp, sp", [(1, False), (4, False), (4, True)])
def test_an_moe_block_moves_its_routed_tokens_permutation(tp, sp) -> None:
    """An MoE block's memory-bound time holds the dispatcher's permutation: (3 top_k + 1) x h
    elements a token forward (gathered into expert order, read back and combined), twice that
    backward; spread over tensor-parallel ranks only under sequence parallelism."""
    model = preset("deepseek-v3")
    chip = chip_for(resolve_cluster("dgx-h100", nodes=1), Batch(8, 4096), CostParams())
    assert chip is not None
    moe = block_times(model, "moe", 1, 4096, tp, 1, sp, 2, 2, True, False, False, chip)
    # the same block with one routed expert a token and its shared width in place of the rest:
    # the same activation bytes, so the difference is the permutation's top_k - 1 copies alone
    one = dataclasses.replace(model, top_k=1, shared_experts=model.shared_experts + model.top_k - 1)
    base = block_times(one, "moe", 1, 4096, tp, 1, sp, 2, 2, True, False, False, chip)
    extra = 4096 * 3 * (model.top_k - 1) * 2 * model.hidden / (tp if sp else 1)
    assert (moe.forward.memory - base.forward.memory) * chip.hbm == pytest.approx(extra)
    assert moe.backward.memory == pytest.approx(2 * moe.forward.memory)


def test_routed_experts_are_grouped_gemms_of_their_own_rows() -> None:
    """The routed experts run as one grouped GEMM over the rank's local experts, each seeing
    tokens x top_k x ep / experts rows: with wave quantisation off, exactly `local` times one
    expert's GEMMs, whose weight gradient reduces over that expert's rows only (a GEMM of all
    the routed rows at once would reduce over `local` times as many, at a smaller fixed cost)."""
    model = preset("deepseek-v3")
    cluster = resolve_cluster("dgx-h100", nodes=1)
    chip = chip_for(cluster, Batch(8, 4096), CostParams())
    assert chip is not None
    flat = dataclasses.replace(chip, sms=0, hbm=0.0)
    tokens, ep = 4096, 8
    local = model.experts // ep
    rows = tokens * model.top_k * ep // model.experts
    h, w = model.hidden, model.expert_ffn
    moe = block_times(model, "moe", 1, tokens, 1, 1, False, 2, 2, True, False, False, flat, ep)
    one_group = block_times(model, "moe", 1, tokens, 1, 1, False, 2, 2, True, False, False,
                             flat, model.experts)  # one expert a rank: one group
    one_up = linear_times(rows, h, 2 * w, flat, 2)
    one_down = linear_times(rows, w, h, flat, 2)
    expected_bwd = local * (one_up[1] + one_down[1])
    rows_one = tokens * model.top_k  # ep = experts: every routed row on its one expert
    other = linear_times(rows_one, h, 2 * w, flat, 2)[1] + linear_times(rows_one, w, h, flat, 2)[1]
    assert moe.backward.gemm - one_group.backward.gemm == pytest.approx(expected_bwd - other)
    # grouped == the sum of its groups when nothing is quantised
    assert linear_times(rows, h, 2 * w, flat, 2, local)[1] == pytest.approx(local * one_up[1])
    # and the weight gradient of small groups costs more than one GEMM of all their rows
    assert linear_times(64, h, 2 * w, flat, 2, 64)[1] > linear_times(64 * 64, h, 2 * w, flat, 2)[1]


def test_gradient_accumulation_around_the_pipeline_fills_and_drains_it_every_call() -> None:
    """`pipeline_local_batch` (AutoModel's LBS): the step's m micro-batches run as m / LBS calls
    of the schedule, each with its own bubble, and each holds only its own micro-batches in
    flight. Every call ends in torch's REDUCE_GRAD (torch/distributed/pipelining/schedules.py
    `_add_reduce_grad`, stage.py `perform_reduce_grad`): FSDP reduce-scatters the stage's
    gradients and reshards its parameters, so a step of 4 calls reduce-scatters and (ZeRO-2)
    gathers 4 times, and a call's forwards meet only its own unsharded gradients, beside the
    shards earlier calls left. Without pipeline parallel, or at 0, nothing changes."""
    def calls(lo: Layout, m: int, local_batch: int) -> tuple[int, int]:
        return lo.pipeline_calls(m, local_batch)

    assert calls(Layout(pp=4, v=8, schedule="interleaved-1f1b"), 32, 8) == (8, 4)
    assert calls(Layout(pp=4, micro_batch=2, schedule="1f1b"), 16, 8) == (4, 4)
    assert calls(Layout(pp=4, schedule="1f1b"), 4, 8) == (4, 1)
    assert calls(Layout(dp_shard=8, zero=2), 32, 8) == (32, 1)
    assert calls(Layout(pp=4, schedule="1f1b"), 32, 0) == (32, 1)
    model = preset("deepseek-v3")
    cluster = resolve_cluster("dgx-h100", nodes=128)
    batch = Batch(8192, 4096)
    lo = Layout(dp_shard=256, zero=2, ep=64, pp=4, v=8, schedule="interleaved-1f1b",
                recompute="full")
    one = predict(lo, model, cluster, batch, CostParams())
    four = predict(lo, model, cluster, batch, CostParams(pipeline_local_batch=8))
    assert four.breakdown["bubble"] == pytest.approx(4 * one.breakdown["bubble"])
    exposed_dp = sum(four.breakdown[k] - one.breakdown[k] for k in ("dp_sync", "param_gather"))
    assert four.step_time_s - one.step_time_s == pytest.approx(
        3 * one.breakdown["bubble"] + exposed_dp, rel=1e-9)
    # FSDP's reduce-scatter and ZeRO-2's gather once a call: 4 times the bytes of one call
    assert four.comm_bytes["dp_shard"] == pytest.approx(4 * one.comm_bytes["dp_shard"])
    _, distinct, _ = rank_groups(model, lo.pp, lo.v, lo.schedule, 4096, lo.recompute,
                                 lo.ac_every, "even")
    per_call = dp_comm(model, distinct[0], lo, 32, "bf16", cluster,
                       CostParams(pipeline_local_batch=8))
    whole = dp_comm(model, distinct[0], lo, 32, "bf16", cluster, CostParams())
    assert (per_call.calls, whole.calls) == (4, 1)
    assert per_call.sync == whole.sync and per_call.param_gather == whole.param_gather
    # interleaved rounds of pp micro-batches hold the same in flight in a call of 8 as of 32
    assert four.memory.activations == one.memory.activations
    # a call of 8 holds its own unsharded gradients and the shards of the earlier calls: a
    # rank near the front reaches fewer of its chunks in backward before its peak in one call
    # of 8 than in one of 32, never more than the whole step's plus the shards
    shards = four.memory.grads_at_step
    assert four.memory.grads <= one.memory.grads + shards
    mem, _ = predict_memory(lo, model, batch, CostParams(pipeline_local_batch=8))
    assert mem.total == four.memory.total
    # 1F1B with calls of 2 micro-batches on 8 stages: rank 0 holds 2, not 8
    plain = Layout(dp_shard=128, zero=2, ep=64, pp=8, schedule="1f1b", recompute="full")
    whole_mem, _ = predict_memory(plain, model, batch, CostParams())
    call_mem, _ = predict_memory(plain, model, batch, CostParams(pipeline_local_batch=2))
    assert call_mem.activations < whole_mem.activations / 2  # (plus one recomputed block)
    assert call_mem.grads == pytest.approx(whole_mem.grads + call_mem.grads_at_step)


def test_plan_of_an_moe_config_prints_the_moe_band(tmp_path, capsys) -> None:
    """`shardwise plan --model config.json` of an MoE model carries the band of the published
    MoE runs, and says so under the table; a dense model's stays the dense runs'."""
    import json

    from shardwise.cli.main import main

    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
              "vocab_size": 151936, "tie_word_embeddings": False, "num_experts": 128,
              "num_experts_per_tok": 8, "moe_intermediate_size": 768, "hidden_act": "silu"}
    path = tmp_path / "qwen3-moe" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config), encoding="utf-8")
    args = ["plan", "--model", str(path), "--cluster", "dgx-h100", "--nodes", "2",
            "--global-batch", "256", "--seq-len", "4096"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "published MoE runs (benchmarks/published_moe.toml)" in out
    band = accuracy.interval("hopper", moe=True)
    assert band is not None
    # every published MoE run was slower than predicted: the footnote says the band is below
    assert band.high < 1 and "the band lies wholly below the prediction" in out
    assert main([*args, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["mfu_interval"] == pytest.approx([best["mfu"] * band.low, best["mfu"] * band.high])


def test_a_reference_sets_model_may_route_every_other_block(tmp_path) -> None:
    """moe_every = 2 with a dense ffn: GPT-OSS's odd blocks routed, its even ones dense."""
    text = MOE.read_text(encoding="utf-8")
    path = tmp_path / "every_other.toml"
    path.write_text(text.replace("expert_ffn = 2880\n", "expert_ffn = 2880\nmoe_every = 2\n"
                                 "ffn = 5760\n", 1), encoding="utf-8")
    model = next(r for r in published.load(path) if r.model.name == "gpt-oss-120b").model
    assert model.moe_every == 2 and model.ffn == 5760
    assert model.layer_kinds == ("dense", "moe") * 18
