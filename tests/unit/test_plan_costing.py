"""The kernel-time model against its formulas, pods and mesh order in placement, `--explain`'s
decomposition, what a run costs, and the CLI's new flags (exit codes and output)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.errors import SpecError
from shardwise.planner import comm, costing, explain, kernels
from shardwise.planner.accuracy import Interval
from shardwise.planner.cluster import PRESETS as CLUSTERS
from shardwise.planner.cluster import resolve_cluster
from shardwise.planner.cost import TERMS, chip_for, predict
from shardwise.planner.layout import Batch, Layout, layout_problem, not_run_today
from shardwise.planner.models import ModelDims, preset
from shardwise.planner.params import CostParams
from shardwise.planner.search import orders
from shardwise.spec.cluster import load_cluster

CHIP = kernels.Chip(peak=1e15, gemm=0.5, attention=0.4, k_half=128.0, sms=100, hbm=2e12)
GPT = ModelDims(name="gpt", layers=4, hidden=1024, heads=8, ffn=4096, vocab=32000, gated=False)


# --- kernels -------------------------------------------------------------------------------------

def test_gemm_time_is_flops_over_the_efficiency_it_earns() -> None:
    # 1280 x 1280 output: 10 x 10 = 100 tiles on 100 SMs, one full wave
    m = n = 1280
    k = 4096
    expected = 2 * m * n * k / (1e15 * 0.5 * k / (k + 128))
    assert kernels.gemm_time(m, n, k, CHIP) == pytest.approx(expected)
    # a partial edge tile and a second, almost empty wave cost their idle tensor cores
    assert kernels.wave_efficiency(1280, 1280, 100) == 1.0
    assert kernels.wave_efficiency(1290, 1280, 100) == pytest.approx(
        (1290 * 1280 / 128**2) / (2 * 100))
    assert kernels.wave_efficiency(64, 64, 0) == 1.0
    # never faster than reading its operands and writing its output
    fast = kernels.Chip(peak=1e18, gemm=0.5, attention=0.4, k_half=0.0, sms=0, hbm=2e12)
    assert kernels.gemm_time(8, 4096, 4096, fast) == pytest.approx(
        2 * (8 * 4096 + 4096 * 4096 + 8 * 4096) / 2e12)


def test_a_batched_gemm_fills_the_sms_with_all_its_problems() -> None:
    """Unfused attention's per-head products are one torch.bmm: 24 problems of 16 x 1 tiles
    (2048 x 96 outputs) share the waves instead of each idling 84 of 100 SMs."""
    m, n, k, heads = 2048, 96, 2048, 24
    compute_bound = kernels.Chip(peak=1e15, gemm=0.5, attention=0.4, k_half=128.0, sms=100,
                                 hbm=0.0)
    one = kernels.gemm_time(m, n, k, compute_bound)
    batched = kernels.gemm_time(m, n, k, compute_bound, 2, heads)
    assert kernels.wave_efficiency(m, n, 100) == pytest.approx((m * n / 128**2) / 100)
    # 24 x 16 = 384 tiles: 4 waves of 100
    eff = kernels.wave_efficiency(m, n, 100, heads)
    assert eff == pytest.approx((heads * m * n / 128**2) / (4 * 100))
    assert batched == pytest.approx(2 * heads * m * n * k / (1e15 * 0.5 * k / (k + 128) * eff))
    assert batched < heads * one / 5
    assert kernels.gemm_time(m, n, k, compute_bound, 2, 1) == one
    # never faster than moving its operands: reading the s x s probabilities binds here
    moved = heads * 2 * (m * k + k * n + m * n) / 2e12
    assert kernels.gemm_time(m, n, k, CHIP, 2, heads) == pytest.approx(max(moved, batched))
    # the unfused attention core times its score and value products as such batched GEMMs
    s, mb, a, hd = 512, 2, 8, 128
    fwd, _ = kernels._attention(mb, s, 1, 1, a, hd, 2, False, False, CHIP)
    per = mb * a
    assert fwd.attention == pytest.approx(kernels.gemm_time(s, s, hd, CHIP, 2, per)
                                          + kernels.gemm_time(s, hd, s, CHIP, 2, per))


def test_memory_bound_bytes_of_a_block_are_counted_per_op() -> None:
    """GeLU block, bf16 (q = r = 2), no dropout, tp 1: forward moves 2 norms x (r+q) + 2 residual
    adds x (q+2r) bytes per hidden element and 2q per FFN element; backward twice that."""
    bt = kernels.block_times(GPT, "dense", 2, 512, 1, 1, False, 2, 2, True, False, False, CHIP)
    tokens = 2 * 512
    fwd_bytes = tokens * ((2 * 4 + 2 * 6) * 1024 + 4 * 4096)
    assert bt.forward.memory == pytest.approx(fwd_bytes / 2e12)
    assert bt.backward.memory == pytest.approx(2 * fwd_bytes / 2e12)
    # fused attention: causal half of the square, backward 2.5x forward
    flops = 2.0 * 2 * 512 * 512 * 8 * 128
    assert bt.forward.attention == pytest.approx(flops / (1e15 * 0.4))
    assert bt.backward.attention == pytest.approx(2.5 * bt.forward.attention)
    # torch's checkpoint stops before the last projection; Megatron's reruns all of it
    whole = kernels.block_times(GPT, "dense", 2, 512, 1, 1, False, 2, 2, True, False, True, CHIP)
    assert whole.recompute == whole.forward and bt.recompute.gemm < bt.forward.gemm


def test_narrow_heads_run_fused_attention_slower() -> None:
    """The fitted attention efficiency is for 128-wide heads. hd / (hd + 56) reproduces
    FlashAttention-3's published bf16 forward on an H100 (497, 648, 756 TFLOP/s at 64, 128, 256:
    Shah et al. 2024, Figure 5) within 1.5 %; narrower heads take that penalty, wider ones get
    no credit (cuDNN and FlashAttention-2 are not faster at 256)."""
    def shape(hd: int) -> float:
        return hd / (hd + kernels.ATTENTION_HD_HALF)

    for hd, tflops in ((64, 497), (256, 756)):
        assert shape(hd) / shape(128) == pytest.approx(tflops / 648, rel=0.015)
    assert kernels.head_width_factor(64) == pytest.approx(shape(64) / shape(128))
    assert kernels.head_width_factor(128) == kernels.head_width_factor(256) == 1.0
    # the same FLOPs (8 heads of 128, 16 of 64) on narrower heads take longer by that factor
    wide = ModelDims(name="w", layers=2, hidden=1024, heads=8, ffn=4096, vocab=32000)
    narrow = dataclasses.replace(wide, name="n", heads=16)
    args = ("dense", 2, 512, 1, 1, False, 2, 2, True, False, False, CHIP)
    ratio = (kernels.block_times(narrow, *args).forward.attention
             / kernels.block_times(wide, *args).forward.attention)
    assert ratio == pytest.approx(1 / kernels.head_width_factor(64))


def test_the_loss_is_an_fp32_cross_entropy_over_the_vocabulary_shard() -> None:
    """Per logit: cast to fp32 (q + 4), log-softmax (3 x 4), dense loss gradient (4), its
    backward (3 x 4), cast back (4 + q); the final norm's 3 passes over the hidden state."""
    tokens, tp, q, r = 2 * 512, 2, 2, 4
    t = kernels.head_times(GPT, 2, 512, tp, 1, q, r, CHIP)
    loss = tokens * (32000 // tp) * (2 * q + 36)
    norm = 3 * tokens * 1024 * (r + q)
    assert t.memory == pytest.approx((loss + norm) / 2e12)
    f, b = kernels.linear_times(tokens, 1024, 32000 // tp, CHIP, q)
    assert t.gemm == pytest.approx(f + b)


def test_tp_collectives_a_framework_overlaps_are_pipelined_with_their_gemms() -> None:
    """tp chunks: the first stays exposed, the rest hide while the GEMM next to that collective
    lasts (its own, not the block's: Transformer Engine's userbuffers and torch's async TP both
    split one GEMM per collective). Llama 3 405B's projections outlast every collective: only
    the first chunks show, 1/8 of the whole. Llama 3 8B's QKV and O projections are shorter than
    an all-gather or reduce-scatter of its hidden state at tp 8: more shows, by the sum over its
    collectives."""
    assert comm.pipelined(8.0, 100.0, 8) == pytest.approx(1.0)
    assert comm.pipelined(8.0, 3.0, 8) == pytest.approx(1.0 + 4.0)
    assert comm.pipelined(8.0, 100.0, 1) == 8.0
    lo = Layout(dp_shard=4, zero=1, tp=8, sequence_parallel=True)
    cluster, batch = resolve_cluster("dgx-h100", nodes=4), Batch(64, 8192)
    big = preset("llama3-405b")
    lo_big = dataclasses.replace(lo, pp=16, schedule="1f1b", recompute="full")
    plain = predict(lo_big, big, cluster, batch, CostParams(overlapped=()))
    overlapped = predict(lo_big, big, cluster, batch, CostParams(overlapped=("tp",)))
    assert plain.breakdown["tp"] > 0
    assert overlapped.breakdown["tp"] == pytest.approx(plain.breakdown["tp"] / 8)
    small = preset("llama3-8b")
    plain = predict(lo, small, cluster, batch, CostParams(overlapped=()))
    overlapped = predict(lo, small, cluster, batch, CostParams(overlapped=("tp",)))
    chip = chip_for(cluster, batch, CostParams())
    assert chip is not None
    fwd, bwd = kernels.tp_paired_gemms(small, 1, 8192, 8, 1, 2, chip)
    assert lo.recompute == "none"
    # per micro-batch: 4 all-gather / reduce-scatter pairs a block, one each for the ends
    c = plain.breakdown["tp"] / plain.micro_batches / (2 * (4 * 32 + 2))
    per_block = sum(comm.pipelined(c, g, 8) for g in (*fwd, *bwd))
    expected = 32 * per_block + 2 * 2 * c / 8
    assert overlapped.breakdown["tp"] / overlapped.micro_batches == pytest.approx(expected)
    assert overlapped.breakdown["tp"] > 1.5 * plain.breakdown["tp"] / 8


def test_fsdp_gathers_hide_by_their_own_share() -> None:
    lo = Layout(dp_shard=32, zero=3)
    cluster, model, batch = resolve_cluster("dgx-h100", nodes=4), preset("llama3-8b"), \
        Batch(64, 8192)
    exposed = {}
    for share in (0.0, 0.5, 1.0):
        p = predict(lo, model, cluster, batch, CostParams(fsdp_overlap=share, overlap=1.0,
                                                          reduce_every_micro_batch=True))
        exposed[share] = p.breakdown["dp_fsdp"]
    assert exposed[0.0] > exposed[0.5] > exposed[1.0] >= 0.0
    assert exposed[0.5] == pytest.approx(exposed[0.0] / 2)


def test_zero2_under_pp_gathers_once_per_step_like_an_overlapped_parameter_gather() -> None:
    """ZeRO-2 under pipeline parallel keeps the stage gathered for the step: its one gather runs
    with the first micro-batch's forward (a per-step term under `overlap`), not per micro-batch
    under FSDP's share; with "dp" not overlapped it is exposed whole."""
    lo = Layout(dp_shard=8, zero=2, tp=8, pp=4, schedule="1f1b", sequence_parallel=True)
    cluster, model, batch = resolve_cluster("dgx-h100", nodes=32), preset("llama3-70b"), \
        Batch(256, 4096)
    hidden = predict(lo, model, cluster, batch, CostParams(fsdp_overlap=0.0, overlap=1.0))
    exposed = predict(lo, model, cluster, batch, CostParams(fsdp_overlap=1.0, overlap=1.0,
                                                            overlapped=()))
    assert hidden.breakdown["dp_fsdp"] == 0.0 == exposed.breakdown["dp_fsdp"]
    assert exposed.breakdown["param_gather"] > hidden.breakdown["param_gather"] >= 0.0
    gather = exposed.breakdown["param_gather"]
    assert hidden.breakdown["param_gather"] == pytest.approx(
        max(gather - hidden.compute_s / hidden.micro_batches / 3, 0.0), rel=0.05)
    # without pipeline parallel the same ZeRO-2 gathers every micro-batch under FSDP's share
    flat = Layout(dp_shard=32, zero=2, tp=8, sequence_parallel=True)
    p = predict(flat, model, cluster, batch, CostParams(fsdp_overlap=0.0))
    assert p.breakdown["dp_fsdp"] > 0.0 and p.breakdown["param_gather"] == 0.0


def test_megatrons_scatter_gather_sends_a_tp_share_and_gathers_it_over_nvlink() -> None:
    """Without sequence parallelism every TP rank sends the whole activation; with Megatron's
    scatter/gather each sends 1/tp and the receivers all-gather it (SC21 §4.1)."""
    lo = Layout(dp_shard=2, zero=1, tp=8, pp=4, schedule="1f1b")
    cluster, model, batch = resolve_cluster("dgx-h100", nodes=8), preset("llama3-70b"), \
        Batch(64, 4096)
    plain = predict(lo, model, cluster, batch, CostParams(overlapped=()))
    split = predict(lo, model, cluster, batch, CostParams(overlapped=(), pp_scatter_gather=True))
    assert 0.0 < split.comm_time_s["pp"] < plain.comm_time_s["pp"] / 2
    assert split.comm_bytes["pp"] == pytest.approx(plain.comm_bytes["pp"] / 8)
    # under sequence parallelism the activation is already split: the flag changes nothing
    sp = Layout(dp_shard=2, zero=1, tp=8, pp=4, schedule="1f1b", sequence_parallel=True)
    assert predict(sp, model, cluster, batch, CostParams(pp_scatter_gather=True)).comm_time_s[
        "pp"] == pytest.approx(predict(sp, model, cluster, batch, CostParams()).comm_time_s["pp"])


def test_a_gpu_steps_host_work_adds_once_per_step_and_a_cpus_does_not() -> None:
    batch = Batch(64, 2048)
    for cluster, added in ((resolve_cluster("dgx-h100", nodes=1), 0.25),
                           (resolve_cluster("cpu-local"), 0.0)):
        model = preset("llama3-8b") if added else GPT
        lo = Layout(dp_shard=cluster.world, zero=3)
        base = predict(lo, model, cluster, batch, CostParams(step_host_s=0.0))
        more = predict(lo, model, cluster, batch, CostParams(step_host_s=0.25))
        assert more.step_time_s - base.step_time_s == pytest.approx(added)
        assert more.breakdown["overhead"] - base.breakdown["overhead"] == pytest.approx(added)


def test_optimizer_step_moves_its_bytes() -> None:
    assert kernels.optimizer_time(1e9, 4, False, CHIP) == pytest.approx(1e9 * 36 / 2e12)
    assert kernels.optimizer_time(1e9, 4, True, CHIP) == pytest.approx(1e9 * 38 / 2e12)


def test_gpu_presets_carry_their_datasheet_device_figures() -> None:
    h100, a100 = CLUSTERS["dgx-h100"](), CLUSTERS["a100-80g"]()
    assert (h100.device.generation, h100.device.memory_bandwidth_gbs, h100.device.sms,
            h100.device.power_w) == ("hopper", 3350.0, 132, 700.0)
    assert (a100.device.generation, a100.device.memory_bandwidth_gbs, a100.device.sms,
            a100.device.power_w) == ("ampere", 2039.0, 108, 400.0)
    assert CLUSTERS["cpu-local"]().device.generation == ""


# --- topology and placement ---------------------------------------------------------------------

def _pods(tmp_path: Path, oversub: float = 7.0, nodes: int = 16, pod: int = 4) -> Path:
    path = tmp_path / f"pods-{oversub}-{nodes}-{pod}.toml"
    path.write_text(f'[cluster]\nbase = "dgx-h100"\nnodes = {nodes}\n[topology]\n'
                    f'pod_nodes = {pod}\npod_oversubscription = {oversub}\n[cost]\n'
                    'price_per_device_hour = 2.0\npue = 1.25\n')
    return path


def test_groups_across_pods_share_the_oversubscribed_uplinks(tmp_path: Path) -> None:
    cluster = resolve_cluster(str(_pods(tmp_path)))
    assert cluster.pod_devices == 32 and cluster.world == 128
    inter = cluster.inter_bytes_per_s_per_device
    inside = comm.group(4, 8, cluster, 1.0, 0.0)  # 4 nodes, one pod
    across = comm.group(16, 8, cluster, 1.0, 0.0)  # 16 nodes, one member per node: 4 per pod
    assert inside.pods == 1 and inside.bandwidth == pytest.approx(inter)
    assert (across.pods, across.per_pod) == (4, 4)
    assert across.bandwidth == pytest.approx(min(inter, 4 * inter / 7.0))
    assert across.pod_bound  # 4 NICs' worth of uplink / 7 is less than the one NIC a member has
    calm = comm.group(16, 8, resolve_cluster(str(_pods(tmp_path, oversub=2.0))), 1.0, 0.0)
    assert calm.bandwidth == pytest.approx(inter) and not calm.pod_bound
    wide = comm.group(4, 32, cluster, 1.0, 0.0)  # one member per pod
    assert wide.bandwidth == pytest.approx(inter / 7.0) and wide.pod_bound
    assert "across 4 pods (1:7)" in wide.link


def test_fsdps_group_under_data_parallel_outermost_is_cp_blocks_repeated(tmp_path: Path) -> None:
    """Under [TP, CP, PP, DP] FSDP shards over dp_shard x cp: cp's block of ranks (one node each
    at tp 8) repeated dp_shard times a pipeline apart. On 16 nodes in pods of 4, cp 4 x dp_shard 4
    with pp 4 between them is four blocks of 4 nodes: 4 members a pod, one a node, as contiguous
    cp x dp would be; it was placed as 16 ranks a pipeline apart (one a pod, 1/7 of a NIC)."""
    cluster = resolve_cluster(str(_pods(tmp_path)))
    inter = cluster.inter_bytes_per_s_per_device
    st = comm.strides(8, 4, 4, 1, 4, "tp-cp-pp-dp")
    assert (st["cp"], st["dp_shard"]) == (8, 128)
    groups, _ = comm.mesh_groups(8, 4, 4, 1, 4, 1, "tp-cp-pp-dp", cluster, 1.0, 0.0)
    shard = groups["shard"]
    assert (shard.size, shard.nodes, shard.per_node, shard.pods, shard.per_pod) == (16, 16, 1, 4, 4)
    assert shard.bandwidth == pytest.approx(min(inter, 4 * inter / 7.0))
    assert shard == comm.group(16, 8, cluster, 1.0, 0.0)  # as cp x dp side by side
    # blocks of 2 nodes, a pod apart (pp 2 between them): 2 members a pod, in 4 pods
    spread = comm.group(2, 8, cluster, 1.0, 0.0, (4, 32))
    assert (spread.size, spread.per_node, spread.pods, spread.per_pod) == (8, 1, 4, 2)
    # without cp, the group is dp_shard's alone: one a pod
    flat, _ = comm.mesh_groups(8, 1, 4, 1, 4, 1, "tp-cp-pp-dp", cluster, 1.0, 0.0)
    assert (flat["shard"].pods, flat["shard"].per_pod) == (4, 1)
    assert flat["shard"].bandwidth == pytest.approx(inter / 7.0)


def test_mesh_orders_place_the_axes_inside_out() -> None:
    assert comm.strides(8, 2, 4, 2, 16) == {"tp": 1, "cp": 8, "dp_shard": 16,
                                            "dp_replicate": 64, "pp": 128, "ep": 8}
    assert comm.strides(8, 2, 4, 2, 16, "tp-cp-pp-dp") == {"tp": 1, "cp": 8, "pp": 16,
                                                           "dp_shard": 256, "dp_replicate": 1024,
                                                           "ep": 8}
    model, batch = preset("llama3-8b"), Batch(64, 8192)
    cluster = resolve_cluster("dgx-h100", nodes=8)
    lo = Layout(dp_shard=4, zero=2, tp=8, pp=2, schedule="1f1b", order="tp-cp-pp-dp")
    assert layout_problem(lo, model, cluster, batch) is None and not_run_today(lo, model)
    assert lo.name().endswith("+dp-outer")
    bad = Layout(dp_shard=4, zero=2, tp=8, pp=2, schedule="1f1b", order="pp-first")
    assert "mesh order" in (layout_problem(bad, model, cluster, batch) or "")


def test_the_search_tries_data_parallel_outermost_only_across_pods(tmp_path: Path) -> None:
    pods = resolve_cluster(str(_pods(tmp_path)))
    flat = resolve_cluster("dgx-h100", nodes=16)
    assert orders(pods, 2, 4) == ("tp-cp-dp-pp", "tp-cp-pp-dp")
    assert orders(flat, 2, 4) == orders(pods, 1, 4) == ("tp-cp-dp-pp",)


@pytest.mark.parametrize("text, word", [
    ("[topology]\npod_oversubscription = 0.5\n", "topology.pod_oversubscription"),
    ("[device]\ngeneration = \"volta\"\n", "device.generation"),
    ("[cost]\npue = 0.9\n", "cost.pue"),
    ("[topology]\npods = 3\n", "topology.pods"),
])
def test_malformed_topology_device_and_cost_name_the_field(tmp_path: Path, text, word) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[cluster]\nbase = "dgx-h100"\n' + text)
    with pytest.raises(SpecError) as err:
        load_cluster(path, presets={n: m() for n, m in CLUSTERS.items()})
    assert word in str(err.value)


# --- explain and cost -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_pred():
    lo = Layout(dp_shard=128, zero=2, tp=8, pp=16, schedule="interleaved-1f1b", v=7,
                sequence_parallel=True, recompute="full")
    return predict(lo, preset("llama3-405b"), resolve_cluster("dgx-h100", nodes=2048),
                   Batch(2048, 8192))


def test_the_breakdown_sums_to_the_step_and_explain_names_every_term(llama_pred) -> None:
    p = llama_pred
    assert set(p.breakdown) == set(TERMS)
    assert sum(p.breakdown.values()) == pytest.approx(p.step_time_s, rel=1e-9)
    text = explain.explain(p, resolve_cluster("dgx-h100", nodes=2048), None, "e = test")
    for term, value in p.breakdown.items():
        if value > 0:
            assert explain.TERM_INFO[term][0] in text
    assert "placement" in text and "tp: NVLink (one node)" in text and "bound:" in text


def test_explain_finds_a_layout_by_rank_or_name(llama_pred) -> None:
    other = predict(Layout(dp_shard=16, zero=3), preset("llama3-8b"),
                    resolve_cluster("dgx-h100", nodes=2), Batch(64, 8192))
    preds = [llama_pred, other]
    assert explain.find(preds, "2") is other
    assert explain.find(preds, llama_pred.layout.name()) is llama_pred
    assert explain.find(preds, llama_pred.layout.name() + " mb1 full") is llama_pred
    assert explain.find(preds, llama_pred.layout.name() + " none") is None
    assert explain.find(preds, "9") is None


def test_run_cost_is_time_power_and_price(tmp_path: Path, llama_pred) -> None:
    cluster = resolve_cluster(str(_pods(tmp_path)))
    band = Interval(low=0.8, high=1.25, runs=10, basis="hopper")
    cost = costing.run_cost(llama_pred, cluster, 15e12, band)
    seconds = 15e12 / llama_pred.tokens_per_s
    assert cost.seconds == pytest.approx(seconds) and cost.days == pytest.approx(seconds / 86400)
    assert cost.device_hours == pytest.approx(128 * seconds / 3600)
    watts = 80.0 + (700.0 - 80.0) * cost.busy
    assert cost.energy_kwh == pytest.approx(128 * seconds * watts * 1.25 / 3.6e6)
    assert cost.money == pytest.approx(cost.device_hours * 2.0)
    assert cost.scale_range == pytest.approx((0.8, 1.25))
    assert 0 < cost.busy <= 1
    assert costing.run_cost(llama_pred, resolve_cluster("dgx-h100"), 1e9).money is None


@pytest.mark.parametrize("text, tokens", [("15T", 15e12), ("300B", 3e11), ("2.5M", 2.5e6),
                                          ("1000", 1e3)])
def test_token_budgets_are_powers_of_ten(text, tokens) -> None:
    assert costing.parse_tokens(text) == tokens
    with pytest.raises(ValueError):
        costing.parse_tokens("lots")


# --- the CLI -------------------------------------------------------------------------------------

def test_cli_tokens_explain_and_the_interval(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(_pods(tmp_path, nodes=2, pod=1)),
                 "--global-batch-tokens", "1M", "--top", "2", "--explain", "1",
                 "--tokens", "1T"]) == 0
    out = capsys.readouterr().out
    assert "MFU band" in out and "on comparable published runs" in out
    assert "step" in out and "placement (mesh order" in out
    assert "a run of 1,000,000,000,000 tokens" in out and "days" in out


@pytest.mark.parametrize("flag, value, word", [("--explain", "100000", "--explain '100000'"),
                                               ("--tokens", "many", "--tokens 'many'")])
def test_cli_bad_explain_or_tokens_exit_2(capsys, flag, value, word) -> None:
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                 "--global-batch-tokens", "1M", flag, value]) == 2
    assert word in capsys.readouterr().err


def test_cli_validate_explains_one_published_run(capsys) -> None:
    """`--validate FILE --explain RUN` breaks that run's prediction down at the layout it was
    predicted at, with its source's stack, at the MFU the table printed for it. Under --json the
    words go to stderr; an unknown id exits 2 naming ids, before any table."""
    import json

    moe = Path(__file__).resolve().parents[2] / "benchmarks" / "published_moe.toml"
    run = "gpt-oss-120b-64b200-26.04.01"
    assert main(["plan", "--validate", str(moe), "--explain", run]) == 0
    out = capsys.readouterr().out
    words = out[out.index(f"\n{run} (megatron-bridge-gpt-oss-b200): measured 19.7 % MFU, "
                          "predicted 30.9 % (+11.2 points)"):]
    assert "zero1-64+ep8 (micro-batch 4" in words and "exposed comm: expert parallel" in words
    assert "tokens/s, 30.9 % MFU" in words.splitlines()[2]
    assert "none is a blackwell run" in words and "memory: 172.7 GiB" in words
    assert main(["plan", "--validate", str(moe), "--explain", run, "--json"]) == 0
    both = capsys.readouterr()
    assert len(json.loads(both.out)) == 12 and f"{run} (megatron" in both.err
    assert main(["plan", "--validate", str(moe), "--explain", "gpt-oss"]) == 2
    both = capsys.readouterr()
    assert "no run of this reference set has that id" in both.err and "(12 runs)" in both.err
    assert "mean absolute" not in both.out


def test_cli_validate_prints_every_row_and_the_score(tmp_path, capsys) -> None:
    reference = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
    assert main(["plan", "--validate", str(reference)]) == 0
    out = capsys.readouterr().out
    assert "sc21-1t" in out and "mean absolute" in out and "by source" in out
    assert "predicted not to fit" not in out  # every published layout ran
    # Llama 3's block with the norms' outputs and SwiGLU's product kept as well (31.75 h bytes a
    # token, not 21.25 h): its 8K rows do not fit, and each says how far it is: allocated, and
    # the allocator waste under which it would fit, or that it would not fit with none
    text = reference.read_text(encoding="utf-8")
    kept = text.replace(", recompute_norms = true, recompute_act = true }", " }")
    assert kept.count("\n") == text.count("\n") and kept != text
    (tmp_path / "kept.toml").write_text(kept, encoding="utf-8")
    assert main(["plan", "--validate", str(tmp_path / "kept.toml")]) == 0
    out = capsys.readouterr().out
    tight = next(line for line in out.splitlines() if line.startswith("  llama3-405b-8k-16384gpu:"))
    assert "73.0 GiB allocated" in tight and "wastes under 7.7 %" in tight and "allows 10 %" in tight
    over = next(line for line in out.splitlines() if line.startswith("  llama3-405b-8k-8192gpu:"))
    assert "90.1 GiB allocated" in over and "no allocator waste at all" in over
    assert main(["plan", "--validate", "/nonexistent.toml"]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("row, stated, words", [
    # Llama 3's split counts the embedding and the head: 128 units, v at most 8 on 16 ranks
    ("llama3-405b-8k-16384gpu", "v = 16", ["llama3-405b-8k-16384gpu", "256 pipeline stages",
                                           "the embedding and the head", "at most 8"]),
    # a plain split: MegaScale's 96 blocks on pp 8 take v at most 12
    ("megascale-megatron-256gpu", "v = 13", ["megascale-megatron-256gpu", "104 pipeline stages",
                                             "96 blocks", "at most 12"])])
def test_cli_validate_refuses_a_stated_v_with_empty_stages(tmp_path, capsys, row, stated,
                                                           words) -> None:
    """More pipeline stages than the split has units is named, with the largest v, before any
    prediction (it was a traceback from deep in the split)."""
    reference = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
    text = reference.read_text(encoding="utf-8")
    start = text.index(f'id = "{row}"')
    line = text.index("layout = {", start)
    end = text.index("\n", line)
    layout = text[line:end]
    bad = layout.replace('v = "unknown"', stated).replace("v = 6", stated)
    assert bad != layout
    path = tmp_path / "runs.toml"
    path.write_text(text[:line] + bad + text[end:], encoding="utf-8")
    assert main(["plan", "--validate", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("stack, words", [
    ('pp_splt = "even"', ["unknown key stack.pp_splt", "pp_split"]),
    ('pp_split = "by_count"', ["stack.pp_split = 'by_count'", '"flops" or "even" or "ends_as_layers"']),
    ('ep_dispatch = "deepep"', ["stack.ep_dispatch = 'deepep'", '"all_to_all" or "deduplicated"']),
    ("reduce_every_micro_batch = 1", ["reduce_every_micro_batch", "true or false"]),
    ("grad_bytes = 3", ["grad_bytes = 3", "2 (fp16/bf16) or 4 (fp32)"]),
    ('overlapped = ["tp", "pipeline"]', ["overlapped", "not pipeline"]),
    ("gemm_efficiency_hopper = 0.7", ["stack.gemm_efficiency_hopper is an efficiency",
                                      "Remove it"])])
def test_cli_validate_names_a_bad_stack_field(tmp_path, capsys, stack, words) -> None:
    """A source's mechanics are checked as a --params file is: a typo was silently ignored and
    a string "yes" read as true."""
    reference = Path(__file__).resolve().parents[2] / "benchmarks" / "published_runs.toml"
    text = reference.read_text(encoding="utf-8")
    old = ("overlapped = [\"pp\", \"dp\", \"dp_under_pp\"], pp_split = \"ends_as_layers\", "
           "recompute_norms = true, recompute_act = true }")
    assert old in text
    path = tmp_path / "runs.toml"
    key = stack.split(" =")[0]
    kept = "" if key.startswith(("pp_spl", "overlapped")) else ", pp_split = \"ends_as_layers\""
    keep_overlap = "" if key == "overlapped" else "overlapped = [\"pp\"], "
    path.write_text(text.replace(old, f"{keep_overlap}{stack}{kept} }}"), encoding="utf-8")
    assert main(["plan", "--validate", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "llama3-405b" in err
    for word in words:
        assert word in err, (word, err)


def test_cli_explains_a_blackwell_layout_naming_whose_efficiencies_it_uses(capsys) -> None:
    """`--explain` on a B200 says the efficiencies are Hopper's fit and that no published run is
    Blackwell's (it had raised an AttributeError: no `gemm_efficiency_blackwell`)."""
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-b200", "--nodes", "2",
                 "--global-batch-tokens", "1M", "--top", "1", "--explain", "1",
                 "--tokens", "1B"]) == 0
    out = capsys.readouterr().out
    assert "hopper's fit on published runs: none is a blackwell run" in out
    assert "none on blackwell" in out and "days" in out
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-b200", "--nodes", "2",
                 "--global-batch-tokens", "1M", "--top", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["interval_basis"]["none_of_generation"] == "blackwell"
    # --json with --explain: stdout stays one JSON document, the decomposition goes to stderr
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-b200", "--nodes", "2",
                 "--global-batch-tokens", "1M", "--top", "1", "--json", "--explain", "1"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)) == 1 and "bound:" in captured.err


def test_cli_json_carries_the_interval(capsys) -> None:
    import json

    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "1",
                 "--global-batch-tokens", "1M", "--top", "1", "--json", "--tokens", "1T"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert row["run"]["days"] == pytest.approx(1e12 / row["tokens_per_s"] / 86400)
    assert row["run"]["money"] is None and row["run"]["energy_kwh"] > 0
    low, high = row["mfu_interval"]
    assert low < row["mfu"] < high and math.isclose(sum(row["breakdown"].values()),
                                                    row["step_time_s"], rel_tol=1e-9)
