"""FLOPs per token against torch's own count, peak FLOP/s lookup and probe, and MFU/HFU <= 100%
on a real step of every model family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.plan import plan_of
from shardwise.parallel.memory import apply_activation_checkpointing
from shardwise.spec.layout import MemorySection
from shardwise.telemetry import peak as peak_mod
from shardwise.telemetry.flops import recomputed_blocks, utilization
from shardwise.telemetry.peak import cpu_peak, gpu_peak, resolve_peak
from tests.support.specs import tiny_spec
from tests.support.workers import train_single

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
    marked = apply_activation_checkpointing(model, plan_of(model), memory)
    recomputed = recomputed_blocks(mode, 2, model.cfg.n_layers)
    assert recomputed == marked == (3 if mode == "full" else 2)
    counts = model.flop_counts()
    counted = _count(model, batch)["total"]
    ours = counts.hardware_per_token(recomputed, causal_halved=False)
    assert abs(counted / ours - 1) < 0.02, (mode, counted, ours)
    assert counts.hardware_per_token(0) == counts.per_token()


def test_gpu_peak_table_by_name_and_precision(monkeypatch):
    """Names as torch.cuda.get_device_name prints them; dense datasheet figures."""
    cases = {
        ("NVIDIA H100 80GB HBM3", "bf16"): 989.4e12,  # SXM
        ("NVIDIA H100 PCIe", "bf16"): 756e12,
        ("NVIDIA H100 NVL", "bf16"): 835.5e12,
        ("NVIDIA H200", "bf16"): 989.4e12,  # SXM
        ("NVIDIA H200 NVL", "fp16"): 835.5e12,
        ("NVIDIA A100-SXM4-40GB", "bf16"): 312e12,
        ("NVIDIA A100-SXM4-80GB", "bf16"): 312e12,
        ("NVIDIA A100 80GB PCIe", "fp16"): 312e12,
        ("NVIDIA L40S", "bf16"): 362.05e12,
        ("NVIDIA L4", "bf16"): 121e12,
        ("NVIDIA B200", "bf16"): 2250e12,  # HGX / DGX B200, 1,000 W
        ("NVIDIA GB200", "bf16"): 2500e12,  # the GB200's, 1,200 W: not read as a B200
        ("NVIDIA H100 80GB HBM3", "fp32"): 66.9e12,  # "highest" precision: no TF32
        ("NVIDIA H100 NVL", "fp32"): 60e12,
        ("NVIDIA A100-SXM4-80GB", "fp32"): 19.5e12,
        ("NVIDIA L40S", "fp32"): 91.6e12,
        ("NVIDIA L4", "fp32"): 30.3e12,
    }
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    for (name, precision), want in cases.items():
        peak = gpu_peak(name, precision)
        assert (peak.flops, peak.source) == (want, "table"), name
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32").flops == 156e12  # TF32 tensor cores
    assert gpu_peak("NVIDIA H200", "fp32").flops == 494.7e12
    assert gpu_peak("NVIDIA L40S", "fp32").flops == 183e12
    assert gpu_peak("NVIDIA L4", "fp32").flops == 60e12
    assert "L40S dense tf32" in gpu_peak("NVIDIA L40S", "fp32").detail
    assert gpu_peak("NVIDIA GH200 480GB", "bf16").flops is None  # not an H200: no guess
    assert gpu_peak("NVIDIA L40", "bf16").flops is None  # neither an L4 nor an L40S


def _fake_gpu(monkeypatch, name: str) -> list[tuple[torch.dtype, float]]:
    """A CUDA device named `name` to resolve_peak, whose probe is a recorded fake."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return []


def _measure(calls: list[tuple[torch.dtype, float]], flops: float = 700e12):
    def measure(dtype: torch.dtype, seconds: float) -> float:
        calls.append((dtype, seconds))
        return flops
    return measure


def test_unknown_gpu_says_once_and_gives_no_peak(monkeypatch, capsys):
    calls = _fake_gpu(monkeypatch, "NVIDIA Imaginary X9")
    monkeypatch.setattr(peak_mod, "_warned", set())
    cuda = torch.device("cuda", 0)
    for _ in range(2):
        peak = resolve_peak(cuda, "bf16", 0.0, None, measure_gpu=_measure(calls))
        assert peak.flops is None and peak.probe == 700e12  # no MFU, but the probe is reported
    err = capsys.readouterr().err
    assert err.count("note: no peak FLOP/s known") == 1 and "telemetry.peak_flops" in err
    override = resolve_peak(cuda, "bf16", 123e12, None, measure_gpu=_measure(calls))
    assert (override.flops, override.source, override.probe) == (123e12, "override", 700e12)


def test_gpu_probe_sits_beside_the_table_and_is_cached(monkeypatch, tmp_path):
    calls = _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("SHARDWISE_PEAK_PROBE_S", "0.4")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    cuda = torch.device("cuda", 0)
    peak = resolve_peak(cuda, "bf16", 0.0, tmp_path, measure_gpu=_measure(calls, 650e12))
    # MFU's denominator stays the datasheet's; the measured figure is reported beside it
    assert (peak.flops, peak.source, peak.probe) == (989.4e12, "table", 650e12)
    assert calls == [(torch.bfloat16, 0.4)]
    assert "bf16 matmul throughput of this GPU (NVIDIA H100 80GB HBM3" in peak.probe_detail
    fields = peak.as_fields()
    assert fields["peak_flops_probe"] == 650e12 and fields["peak_flops"] == 989.4e12
    again = resolve_peak(cuda, "bf16", 0.0, tmp_path, measure_gpu=_measure(calls, 1.0))
    assert again.probe == 650e12 and "cached in" in again.probe_detail and len(calls) == 1
    # another dtype, or fp32 with TF32 on and then off: three more probes, each in fp32 or bf16
    resolve_peak(cuda, "fp32", 0.0, tmp_path, measure_gpu=_measure(calls, 400e12))
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    plain = resolve_peak(cuda, "fp32", 0.0, tmp_path, measure_gpu=_measure(calls, 50e12))
    assert [c[0] for c in calls] == [torch.bfloat16, torch.float32, torch.float32]
    assert (plain.flops, plain.probe) == (66.9e12, 50e12)
    keys = [json.loads(f.read_text())["key"] for f in (tmp_path / "peak-flops").glob("gpu-*.json")]
    assert sorted((k["dtype"], k["tf32"]) for k in keys) == [("bf16", False), ("fp32", False),
                                                             ("fp32", True)]
    assert {k["gpu"] for k in keys} == {"NVIDIA H100 80GB HBM3"}
    assert {k["torch"] for k in keys} == {torch.__version__}
    # another GPU model is probed again
    _fake_gpu(monkeypatch, "NVIDIA H200")
    resolve_peak(cuda, "bf16", 0.0, tmp_path, measure_gpu=_measure(calls, 660e12))
    assert len(calls) == 4


def test_gpu_probe_off_or_failing_leaves_the_peak(monkeypatch):
    calls = _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("SHARDWISE_PEAK_PROBE_S", "0")
    off = resolve_peak(cuda, "bf16", 0.0, None, measure_gpu=_measure(calls))
    assert (off.flops, off.probe, calls) == (312e12, None, []) and "off" in off.probe_detail
    monkeypatch.setenv("SHARDWISE_PEAK_PROBE_S", "0.1")

    def out_of_memory(dtype: torch.dtype, seconds: float) -> float:
        raise torch.OutOfMemoryError("CUDA out of memory")

    failed = resolve_peak(cuda, "bf16", 0.0, None, measure_gpu=out_of_memory)
    assert (failed.flops, failed.probe) == (312e12, None)
    assert "probe failed: CUDA out of memory" in failed.probe_detail


def test_ranks_agree_on_one_peak_and_probe():
    from shardwise.telemetry.peak import Peak
    from shardwise.telemetry.perf import _agreed_peak

    local = Peak(989.4e12, "table", "H100", 600e12, "probe")
    agreed = _agreed_peak(local, [[989.4e12, 600e12], [989.4e12, 640e12]])
    assert (agreed.flops, agreed.probe) == (989.4e12, 640e12)
    one_failed = _agreed_peak(local, [[989.4e12, 600e12], [989.4e12, 0.0]])
    assert (one_failed.flops, one_failed.probe) == (989.4e12, None)
    unknown = _agreed_peak(Peak(None, "unknown", "?"), [[0.0, 0.0], [0.0, 0.0]])
    assert (unknown.flops, unknown.source, unknown.probe) == (None, "unknown", None)


def test_cpu_probe_is_measured_once_and_cached(tmp_path):
    first = cpu_peak("fp32", tmp_path, seconds=0.15)
    assert first.source == "cpu-probe" and first.flops > 1e8
    assert "not a datasheet peak" in first.detail
    files = list((tmp_path / "peak-flops").glob("cpu-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["key"]["threads"] == torch.get_num_threads()
    again = cpu_peak("fp32", tmp_path, seconds=5.0)  # a cache hit: no 5 s probe
    assert again.flops == first.flops and "cached in" in again.detail
    assert (again.probe, again.probe_detail) == (again.flops, again.detail)  # the probe is the peak
    assert utilization(first.flops, 1.0, 1, first.flops) == 1.0
    assert utilization(1.0, 1.0, 1, None) is None


@pytest.mark.parametrize("family", ["gpt", "moe-gpt"])  # the built-in families with FLOP counts
def test_mfu_and_hfu_never_exceed_one_on_a_real_step(family, small_corpus, tmp_path, monkeypatch):
    """A real run of every built-in family with activation recompute, against the CPU probe:
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
    assert start["peak_flops_probe"] == start["peak_flops"]  # on a CPU the probe is the peak
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
    assert telemetry["peak_flops_probe"] == start["peak_flops"]
    assert telemetry["flops_formula"].startswith("model_flops_per_token = 6*N")
    assert telemetry["recomputed_blocks"] == 2
