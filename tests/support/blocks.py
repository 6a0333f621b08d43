"""The built-in transformer block on its own, for tests that count what its ops move or keep."""

from __future__ import annotations

import torch

from shardwise.models.gpt import GPTConfig, TransformerBlock, rope_tables


def probe_block(h: int, heads: int, kv: int, ffn: int, tokens: int, dtype: torch.dtype
                ) -> tuple[TransformerBlock, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block, cos, sin, x): one seeded block of these sizes in `dtype`, its rotary tables and an
    input of one sequence of `tokens` that requires grad."""
    cfg = GPTConfig(vocab_size=64, seq_len=tokens, n_layers=1, d_model=h, n_heads=heads,
                    n_kv_heads=kv, ffn_hidden=ffn)
    torch.manual_seed(0)
    block = TransformerBlock(cfg).to(dtype)
    cos, sin = rope_tables(cfg.head_dim, tokens, cfg.rope_theta)
    x = torch.randn(1, tokens, h, dtype=dtype, requires_grad=True)
    return block, cos, sin, x
