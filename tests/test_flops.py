"""FLOPs per token against torch's own count, peak FLOP/s lookup and probe, and MFU/HFU <= 100%
on a real step of every model family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_spec
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.memory import apply_activation_checkpointing
from shardwise.spec.runspec import MODEL_FAMILIES, MemorySection
from shardwise.telemetry import peak as peak_mod
from shardwise.telemetry.flops import recomputed_blocks, utilization
from shardwise.telemetry.peak import cpu_peak, gpu_peak, resolve_peak
from workers import train_single

#: name -> (GPTConfig kwargs, batch): grouped-query / multi-head / multi-query attention, tied and
#: untied output, three sequence lengths
SHAPES = {
    "gqa-tied-t32": (dict(vocab_size=512, seq_len=32, n_layers=2, d_model=64, n_heads=4,
                          n_kv_heads=2, ffn_hidden=128, tie_embeddings=True), 2),
    "mha-untied-t64": (dict(vocab_size=384, seq_len=64, n_layers=3, d_model=96, n_heads=6,
                            n_kv_heads=6, ffn_hidden=256, tie_embeddings=False), 2),
    "mqa-untied-t128": (dict(vocab_size=256, seq_len=128, n_layers=2, d_model=64, n_heads=8,
                             n_kv_heads=1, ffn_hidden=192, tie_embeddings=False), 1),
}


def _count(model: GPT, batch: int) -> dict[str, float]:
    """Per-token FLOPs torch counts on one forward + backward, split into the matmuls of the
    linear layers (aten.mm) and the attention matmuls (aten.bmm).

    The math SDPA backend is used because FlopCounterMode has no formula for the CPU flash kernel
    (`_scaled_dot_product_flash_attention_for_cpu`; it would count 0 for attention). The math
    backend multiplies the full T×T square and masks it, and the counter's SDPA formulas ignore
    `is_causal` as well, so the count is compared with the *un-halved* attention term."""
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len),
                           generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model(tokens).float().sum().backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    n = tokens.numel()
    return {"total": counter.get_total_flops() / n, "mm": by_op.get("aten.mm", 0) / n,
            "bmm": by_op.get("aten.bmm", 0) / n}


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_per_token_matches_flop_counter(name):
    kwargs, batch = SHAPES[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kwargs))
    counts = model.flop_counts()
    counted = _count(model, batch)
    ours = counts.per_token(causal_halved=False)
    assert abs(counted["total"] / ours - 1) < 0.02, (name, counted, ours)
    # and term by term: 6N is the linear layers' matmuls, 12·L·H·Q·T the attention's
    assert abs(counted["mm"] / (6 * counts.matmul_params) - 1) < 0.02
    assert abs(counted["bmm"] / counts.attention(counts.n_layers, 3, causal_halved=False) - 1) < 0.02
    # the declared MFU numerator counts the causal half of the attention square
    full = 12 * counts.n_layers * counts.n_heads * counts.head_dim * counts.seq_len
    assert counts.per_token() == ours - full / 2
    assert model.flops_per_token() == ours  # the model's own figure is the counter's convention


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_hardware_flops_count_the_recomputed_forward(mode):
    """Under activation checkpointing torch really runs each marked block's forward twice; the
    counter sees it, and hardware FLOPs predict it (the block count by the trainer's own rule)."""
    kwargs, batch = SHAPES["mha-untied-t64"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**kwargs))
    memory = MemorySection(activation_checkpoint=mode, ac_every=2)
    marked = apply_activation_checkpointing(model, memory)
    recomputed = recomputed_blocks(mode, 2, model.cfg.n_layers)
    assert recomputed == marked == (3 if mode == "full" else 2)
    counts = model.flop_counts()
    counted = _count(model, batch)["total"]
    ours = counts.hardware_per_token(recomputed, causal_halved=False)
    assert abs(counted / ours - 1) < 0.02, (mode, counted, ours)
    assert counts.hardware_per_token(0) == counts.per_token()


def test_gpu_peak_table_by_name_and_precision(monkeypatch):
    cases = {
        ("NVIDIA H100 80GB HBM3", "bf16"): 989.4e12,
        ("NVIDIA H100 PCIe", "bf16"): 756e12,
        ("NVIDIA H200", "bf16"): 989.4e12,
        ("NVIDIA A100-SXM4-40GB", "bf16"): 312e12,
        ("NVIDIA A100 80GB PCIe", "fp16"): 312e12,
        ("NVIDIA H100 80GB HBM3", "fp32"): 66.9e12,  # "highest" precision: no TF32
        ("NVIDIA A100-SXM4-80GB", "fp32"): 19.5e12,
    }
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    for (name, precision), want in cases.items():
        peak = gpu_peak(name, precision)
        assert (peak.flops, peak.source) == (want, "table"), name
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == 156e12  # TF32 tensor cores
    assert gpu_peak("NVIDIA GH200 480GB", "bf16").flops is None  # not an H200: no guess


def test_unknown_gpu_says_once_and_gives_no_peak(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X9")
    monkeypatch.setattr(peak_mod, "_warned", set())
    cuda = torch.device("cuda", 0)
    for _ in range(2):
        assert resolve_peak(cuda, "bf16", 0.0, None).flops is None
    err = capsys.readouterr().err
    assert err.count("note: no peak FLOP/s known") == 1 and "telemetry.peak_flops" in err
    override = resolve_peak(cuda, "bf16", 123e12, None)
    assert (override.flops, override.source) == (123e12, "override")


def test_cpu_probe_is_measured_once_and_cached(tmp_path):
    first = cpu_peak("fp32", tmp_path, seconds=0.15)
    assert first.source == "cpu-probe" and first.flops > 1e8
    assert "not a datasheet peak" in first.detail
    files = list((tmp_path / "peak-flops").glob("cpu-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["key"]["threads"] == torch.get_num_threads()
    again = cpu_peak("fp32", tmp_path, seconds=5.0)  # a cache hit: no 5 s probe
    assert again.flops == first.flops and "cached in" in again.detail
    assert utilization(first.flops, 1.0, 1, first.flops) == 1.0
    assert utilization(1.0, 1.0, 1, None) is None


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_mfu_and_hfu_never_exceed_one_on_a_real_step(family, small_corpus, tmp_path, monkeypatch):
    """A real run of every registered family with activation recompute, against the CPU probe:
    0 < MFU < HFU <= 1 in every step event, and the manifest names formula, peak and source."""
    monkeypatch.setenv("SHARDWISE_PEAK_PROBE_S", "0.3")
    spec = tiny_spec(small_corpus, tmp_path / "run", run={"steps": 3},
                     model={"family": family, "n_layers": 2, "d_model": 128, "n_heads": 4,
                            "n_kv_heads": 2, "ffn_hidden": 512},
                     data={"seq_len": 64}, batch={"global_batch": 8, "micro_batch": 4},
                     memory={"activation_checkpoint": "full"})
    train_single(spec)
    run = Path(spec.run.dir)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["kind"] == "run_start")
    assert start["peak_flops_source"] == "cpu-probe" and start["peak_flops"] > 0
    assert start["hardware_flops_per_token"] > start["flops_per_token"]
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == 3
    for e in steps:
        assert 0 < e["mfu"] < e["hfu"] <= 1, e
        assert e["samples_per_s"] > 0
    telemetry = json.loads((run / "manifest.json").read_text())["telemetry"]
    assert telemetry["peak_flops"] == start["peak_flops"]
    assert telemetry["peak_flops_source"] == "cpu-probe"
    assert "not a datasheet peak" in telemetry["peak_flops_detail"]
    assert telemetry["flops_formula"].startswith("model_flops_per_token = 6*N")
    assert telemetry["recomputed_blocks"] == 2
