"""The GPT: parameter count, FLOPs per token, grouped-query attention, causality, seeded init."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.registry import build_model
from shardwise.spec.model import ModelSection

VOCAB = 512
SEQ = 128
SMALL = ModelSection.of(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)


def model(section: ModelSection = SMALL, seed: int = 0, seq_len: int = SEQ) -> GPT:
    return build_model(section, vocab_size=VOCAB, seq_len=seq_len, seed=seed)


def hand_count(section: ModelSection, vocab: int, ffn: int) -> int:
    f = section.fields
    d, h, kv, layers = f.d_model, f.n_heads, f.n_kv_heads, f.n_layers
    hd = d // h
    per_layer = (d * h * hd          # wq
                 + 2 * d * kv * hd   # wk, wv
                 + h * hd * d        # wo
                 + 3 * d * ffn       # w1, w3, w2
                 + 2 * d)            # attention_norm, ffn_norm
    total = vocab * d + layers * per_layer + d  # embedding, blocks, final norm
    if not section.fields.tie_embeddings:
        total += vocab * d  # a separate output projection
    return total


def hand_flops(section: ModelSection, vocab: int, seq_len: int, ffn: int) -> float:
    f = section.fields
    d, h, kv, layers = f.d_model, f.n_heads, f.n_kv_heads, f.n_layers
    hd = d // h
    n_matmul = layers * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * ffn) + d * vocab
    return 6.0 * n_matmul + 12.0 * layers * h * hd * seq_len


@pytest.mark.parametrize("tie", [True, False])
def test_num_params_matches_hand_count(tie):
    section = ModelSection.of(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                           tie_embeddings=tie)
    m = model(section)
    want = hand_count(section, VOCAB, ffn=128)
    assert want == (106_816 if tie else 106_816 + VOCAB * 64)  # the arithmetic, done once by hand
    assert m.num_params() == want
    assert m.num_params(exclude_embeddings=True) == want - VOCAB * 64
    assert (m.output.weight is m.tok_embeddings.weight) is tie
    # the count agrees with the unique tensors torch holds
    assert m.num_params() == sum(p.numel() for p in set(m.parameters()))


def test_default_ffn_width_and_count():
    """ffn_hidden = 0 -> 8/3 * d_model rounded up to a multiple of 64: 64 -> 170.67 -> 192."""
    section = ModelSection.of(n_layers=3, d_model=64, n_heads=4, n_kv_heads=1, ffn_hidden=0)
    cfg = GPTConfig.from_fields(section.fields, vocab_size=VOCAB, seq_len=SEQ)
    assert cfg.ffn_hidden == 192
    assert cfg.head_dim == 16
    assert model(section).num_params() == hand_count(section, VOCAB, ffn=192)
    # the default model section: 8/3 * 192 = 512, already a multiple of 64
    assert GPTConfig.from_fields(ModelSection.of(d_model=192).fields, VOCAB, SEQ).ffn_hidden == 512


@pytest.mark.parametrize("tie", [True, False])
def test_flops_per_token_formula(tie):
    section = ModelSection.of(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                           tie_embeddings=tie)
    m = model(section)
    want = hand_flops(section, VOCAB, SEQ, ffn=128)
    assert want == 835_584.0  # 6 * 106_496 matmul weights + 12 * 2 * 4 * 16 * 128
    assert m.flops_per_token() == want  # tying does not change the matmul count


def test_flops_per_token_matches_flop_counter():
    """One forward + backward, batch 2 at full seq_len, counted by torch, per token.

    The math SDPA backend is used because FlopCounterMode has no formula for the CPU flash kernel
    (`_scaled_dot_product_flash_attention_for_cpu`): with the default CPU kernel it counts 0 for
    attention and the ratio is 6N / (6N + attention) = 0.765 for this model. The math backend
    runs the full T x T matmuls, the same convention as the 12·L·H·Q·T term.
    """
    m = model()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        m(tokens).float().sum().backward()
    measured = counter.get_total_flops() / tokens.numel()
    ratio = measured / m.flops_per_token()
    assert abs(ratio - 1) < 0.02, f"measured/predicted = {ratio:.4f}"


def test_output_shape_and_gqa_matches_repeated_heads():
    """GQA with 2 KV heads equals full multi-head attention whose K/V heads are the shared ones,
    each repeated for its group of query heads."""
    gqa = model()
    mha_section = ModelSection.of(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, ffn_hidden=128)
    mha = model(mha_section, seed=1)
    assert mha.num_params() == hand_count(mha_section, VOCAB, ffn=128)
    state = gqa.state_dict()
    hd, group = 16, 2
    for name in list(state):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = state[name].view(2, hd, 64)  # (kv_heads, head_dim, d_model)
            state[name] = w.repeat_interleave(group, dim=0).reshape(4 * hd, 64)
    mha.load_state_dict(state)
    tokens = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_gqa, out_mha = gqa(tokens), mha(tokens)
    assert out_gqa.shape == (3, 40, VOCAB)
    assert out_mha.shape == (3, 40, VOCAB)
    assert torch.isfinite(out_mha).all()
    torch.testing.assert_close(out_mha, out_gqa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_causality(kv):
    m = model(ModelSection.of(n_layers=2, d_model=64, n_heads=4, n_kv_heads=kv, ffn_hidden=128))
    tokens = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    p = 37
    changed[:, p] = (tokens[:, p] + 1) % VOCAB
    with torch.no_grad():
        a, b = m(tokens), m(changed)
    assert a.shape == (2, 64, VOCAB)
    torch.testing.assert_close(a[:, :p], b[:, :p], rtol=0, atol=0)  # earlier: bit-identical
    assert (a[:, p:] - b[:, p:]).abs().amax(dim=-1).min() > 0  # position p and later do change


def test_prefix_logits_do_not_depend_on_length():
    """Causal, rotary by absolute position: a prefix gets the logits it has in the full sequence."""
    m = model()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, prefix = m(tokens), m(tokens[:, :50])
    torch.testing.assert_close(prefix, full[:, :50], rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_refused():
    m = model(seq_len=16)
    with pytest.raises(ValueError, match="17 tokens exceeds the model's seq_len 16"):
        m(torch.zeros(1, 17, dtype=torch.long))


def test_same_seed_same_weights_different_seed_different():
    a, b, c = model(seed=5), model(seed=5), model(seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(sa[name], torch.ones_like(sa[name]))  # norms start at 1
            assert torch.equal(sa[name], sc[name])
        else:
            assert not torch.equal(sa[name], sc[name]), name


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    model(seed=9)
    assert torch.equal(torch.rand(4), want)


def test_init_scales():
    """Normal(0, 0.02) weights; residual projections (wo, w2) use 0.02 / sqrt(2 * n_layers)."""
    section = ModelSection.of(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=512)
    m = model(section, seed=0)
    params = dict(m.named_parameters())
    residual = 0.02 / (2 * 4) ** 0.5
    assert params["layers.0.feed_forward.w2.weight"].std().item() == pytest.approx(residual,
                                                                                  rel=0.05)
    assert params["layers.3.attention.wo.weight"].std().item() == pytest.approx(residual, rel=0.05)
    assert params["layers.1.feed_forward.w1.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert params["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
