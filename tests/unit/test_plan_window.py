"""Sliding-window attention (Mistral, Gemma 2/3, GPT-OSS, Qwen2 with use_sliding_window): a
windowed block's queries attend the last w tokens, so its score and value matmuls count
w - w²/(2T) keys a query instead of the causal T/2: in the MFU formula (`telemetry.flops`), in the
planner's fused-attention kernel time, from a Hugging Face config.json (the planner) and from a
loaded config (the runtime's Hugging Face family), and in a reference set's [models] table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardwise.planner import published
from shardwise.planner.hf_config import dims_from_hf_config
from shardwise.planner.kernels import Chip, block_times
from shardwise.planner.models import ModelDims
from shardwise.shape import hf_sliding_window
from shardwise.telemetry.flops import FlopCounts, attended_keys
from tests.support.reference_sets import refusal
from tests.support.specs import ROOT

MOE_SET = ROOT / "benchmarks" / "published_moe.toml"
H100 = Chip(peak=989e12, gemm=0.55, attention=0.55, k_half=181.0, sms=132, hbm=3.35e12)

MISTRAL_7B = dict(model_type="mistral", num_hidden_layers=32, hidden_size=4096,
                  num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                  vocab_size=32000, tie_word_embeddings=False, sliding_window=4096,
                  max_position_embeddings=32768)


def _keys_by_mask(seq_len: int, window: int) -> float:
    """The mean number of keys a query attends, counted from the mask itself: query i sees keys
    max(0, i - w + 1) .. i."""
    return sum(min(i + 1, window) for i in range(seq_len)) / seq_len


@pytest.mark.parametrize("seq_len, window", [(4096, 128), (32768, 4096), (8192, 8191),
                                             (1024, 1024), (1024, 4096)])
def test_attended_keys_is_the_masks_count(seq_len: int, window: int) -> None:
    """Within half a key of the mask's own count (the formula is the continuous one the causal
    T/2 already is), and exactly T/2 once the window spans the sequence."""
    assert attended_keys(seq_len, window) == pytest.approx(_keys_by_mask(seq_len, window), abs=0.5)
    if window >= seq_len:
        assert attended_keys(seq_len, window) == seq_len / 2
    assert attended_keys(seq_len, 0) == seq_len / 2


def test_the_mfu_formula_counts_the_windowed_blocks_keys() -> None:
    """Half the blocks windowed at w: the attention term is the mean of the causal block's and
    the windowed block's; the full square (FlopCounterMode's count) does not change."""
    base = FlopCounts(n_layers=36, layer_matmul_params=1000, head_matmul_params=10, n_heads=64,
                      head_dim=64, seq_len=4096)
    half = dataclasses.replace(base, window=128, window_share=0.5)
    per_block = 12 * 64 * 64  # 12·H·Q a key, forward and backward
    causal, windowed = 4096 / 2, attended_keys(4096, 128)
    assert base.per_token() == pytest.approx(6 * base.matmul_params + 36 * per_block * causal)
    assert half.per_token() == pytest.approx(
        6 * base.matmul_params + 36 * per_block * (causal + windowed) / 2)
    assert half.per_token(causal_halved=False) == base.per_token(causal_halved=False)
    assert half.recompute_per_token(4) < base.recompute_per_token(4)


@pytest.mark.parametrize("config, expect", [
    (MISTRAL_7B, (4096, 32)),  # every block
    (dict(MISTRAL_7B, model_type="qwen2", use_sliding_window=False, sliding_window=32768), (0, 0)),
    (dict(MISTRAL_7B, model_type="qwen2", use_sliding_window=True, max_window_layers=28),
     (4096, 4)),  # blocks from index 28 on
    (dict(MISTRAL_7B, model_type="gemma2", num_hidden_layers=42), (4096, 21)),  # even blocks
    (dict(MISTRAL_7B, model_type="gemma3_text", num_hidden_layers=34, sliding_window=1024,
          sliding_window_pattern=6), (1024, 29)),  # every 6th global
    (dict(MISTRAL_7B, model_type="gpt_oss", num_hidden_layers=36, sliding_window=128,
          layer_types=["sliding_attention", "full_attention"] * 18), (128, 18)),
    (dict(MISTRAL_7B, sliding_window=None), (0, 0)),
    (dict(MISTRAL_7B, sliding_window=True), (0, 0)),
])
def test_hugging_face_conventions_for_which_blocks_are_windowed(config, expect) -> None:
    layers = config["num_hidden_layers"]
    assert hf_sliding_window(config.get, layers) == expect


def test_a_windowed_config_plans_cheaper_attention_at_long_context(tmp_path: Path) -> None:
    """Mistral 7B at 32K: the planner reads its window (and says so), the model FLOPs drop by the
    attention it leaves out, and the fused kernel's time by the keys it skips (plus half a tile
    at the window's far edge), while the same config without the window is planned causal."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MISTRAL_7B))
    windowed = dims_from_hf_config(path)
    causal = dataclasses.replace(windowed, window=0, window_layers=0)
    assert (windowed.window, windowed.window_layers) == (4096, 32)
    assert "a sliding window of 4096 in every block" in windowed.describe()
    seq = 32768
    saved = (seq / 2 - attended_keys(seq, 4096)) * 12 * 32 * 128 * 32
    assert causal.flop_counts(seq).per_token() - windowed.flop_counts(seq).per_token() \
        == pytest.approx(saved)
    args = ("dense", 1, seq, 1, 1, False, 2, 2, True, False, False, H100)
    ratio = block_times(windowed, *args).forward.attention / block_times(causal, *args).forward.attention
    assert ratio == pytest.approx((attended_keys(seq, 4096) + 64) / (seq / 2))
    # a window longer than the sequence changes nothing
    assert windowed.flop_counts(4096).per_token() == causal.flop_counts(4096).per_token()
    assert block_times(windowed, "dense", 1, 4096, *args[3:]).forward.attention == \
        block_times(causal, "dense", 1, 4096, *args[3:]).forward.attention


def test_a_reference_sets_model_states_its_window(tmp_path: Path) -> None:
    """GPT-OSS's 128-token window in 18 of its 36 blocks; window alone means every block; bad
    values in words."""
    oss = next(r for r in published.load(MOE_SET) if r.model.name == "gpt-oss-120b").model
    assert (oss.window, oss.window_layers, oss.window_share) == (128, 18, 0.5)
    text = MOE_SET.read_text(encoding="utf-8")
    every = tmp_path / "every.toml"
    every.write_text(text.replace("window_layers = 18\n", "", 1), encoding="utf-8")
    oss = next(r for r in published.load(every) if r.model.name == "gpt-oss-120b").model
    assert oss.window_layers == 36
    for old, new, words in [
            ("window = 128\n", "", "window_layers = 18 needs window"),
            ("window_layers = 18", "window_layers = 40", "from 1 to layers = 36"),
            ("window = 128", "window = 0", "window = 0 must be a whole number"),
            ("window = 128", 'window = "128"', "window = '128' must be a whole number")]:
        assert words in refusal(MOE_SET, old, new, tmp_path)


def test_the_runtime_hugging_face_family_counts_the_window() -> None:
    """A tiny Mistral built by the Hugging Face family: its plan's shape and FLOP counts carry the
    window, so a run's MFU counts the keys its attention attends."""
    pytest.importorskip("transformers")
    from shardwise.models.registry import describe_model
    from shardwise.spec.model import ModelSection

    config = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "sliding_window": 16}
    plan = describe_model(ModelSection.of(family="hf", hf_config=config), 128, 64)
    assert (plan.shape.window, plan.shape.window_layers) == (16, 2)
    assert plan.flop_counts.window == 16 and plan.flop_counts.window_share == 1.0
    assert plan.flop_counts.keys() == pytest.approx(attended_keys(64, 16))
    assert ModelDims.from_shape(plan.shape, "tiny").window_share == 1.0


def test_context_parallel_refuses_a_windowed_config_by_the_same_rule() -> None:
    """Ring attention runs plain causal attention: a config with windowed blocks is refused before
    launch, in words; one whose window is switched off (Qwen2's use_sliding_window = false) is
    not."""
    transformers = pytest.importorskip("transformers")
    from shardwise.errors import UserError
    from shardwise.models.hf.attention import check_context_parallel

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UserError, match=r"sliding_window = 16\. Use parallel\.cp = 1"):
        check_context_parallel(transformers.MistralConfig(sliding_window=16, **small))
    check_context_parallel(transformers.Qwen2Config(use_sliding_window=False,
                                                    sliding_window=16, **small))
    check_context_parallel(transformers.MistralConfig(sliding_window=None, **small))


def test_the_plan_never_writes_context_parallel_for_a_windowed_model(tmp_path: Path,
                                                                        capsys) -> None:
    """The planner costs cp on a windowed model (the ring's work is what a windowed ring would
    do), but shardwise refuses it (above): such layouts are marked as not run today in the table
    and the JSON, and `--write-spec` writes the best layout without cp. Expert parallel, which
    shardwise runs, is not marked."""
    from shardwise.cli.main import main
    from shardwise.planner.layout import Layout, not_run_today

    path = tmp_path / "config.json"
    path.write_text(json.dumps(MISTRAL_7B))
    windowed = dims_from_hf_config(path)
    causal = dataclasses.replace(windowed, window=0, window_layers=0)
    cp2 = Layout(dp_shard=2, zero=2, cp=2)
    assert "sliding-window" in (not_run_today(cp2, windowed) or "")
    assert not_run_today(cp2, causal) is None
    assert not_run_today(Layout(dp_shard=8, zero=2, ep=8), causal) is None
    assert "dp-outer" in (not_run_today(Layout(dp_shard=2, zero=2, pp=2, schedule="1f1b",
                                                order="tp-cp-pp-dp"), causal) or "")
    out = tmp_path / "plan.toml"
    assert main(["plan", "--model", str(path), "--cluster", "dgx-h100", "--nodes", "1",
                 "--seq-len", "32768", "--global-batch", "16", "--json", "--top", "100000",
                 "--write-spec", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["cp"] > 1 for r in rows)
    assert all(r["available"] == (r["cp"] == 1) for r in rows)
    written = next(r for r in rows if r["available"])
    assert f"# layout {written['name']}:" in out.read_text()
