"""The attention function shardwise registers with transformers, so that context parallel can
replace a Hugging Face model's attention core like the built-in GPT's.

transformers looks the attention up by `config._attn_implementation` in its
`AttentionInterface`; shardwise builds every HF model with its own entry, "shardwise", which
calls the attention module's `attention_fn` when `shardwise.parallel.context` has set one (ring
attention over the cp group), and otherwise transformers' own SDPA path with the same
arguments (so the logits are bitwise HF's SDPA ones). The mask: shardwise never passes padding
(sequences are packed, attention is causal), and a mask function registered for "shardwise"
returns None, so transformers builds no mask that ring attention would silently drop; a module
that is not causal, scales scores other than by 1/sqrt(head_dim), uses dropout or a sliding
window is refused under context parallel rather than computed differently.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shardwise.shape import hf_sliding_window

NAME = "shardwise"
ATTENTION_ATTR = "attention_fn"


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the implementation name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, shardwise_attention)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


def _no_mask(*_: Any, **__: Any) -> None:
    """Causal attention needs no mask tensor: SDPA's is_causal and ring attention's own block
    masks apply it (shardwise never passes padding masks)."""
    return None


def install(modules: list[nn.Module]) -> None:
    """Give each attention module the `attention_fn` slot context parallel swaps (`hf_sdpa`:
    transformers' own SDPA path)."""
    for module in modules:
        setattr(module, ATTENTION_ATTR, hf_sdpa)


def hf_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Marker for "transformers' own SDPA" (never called: `shardwise_attention` sees it and runs
    the SDPA path with the module's own arguments)."""
    raise AssertionError("hf_sdpa is a marker")


def shardwise_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fn = getattr(module, ATTENTION_ATTR, hf_sdpa)
    if fn is hf_sdpa:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    _check_plain_causal(module, query, attention_mask, dropout, scaling, kwargs)
    out = fn(query, key, value)  # (B, H, T, D), K/V heads not repeated
    return out.transpose(1, 2).contiguous(), None


def _check_plain_causal(module: nn.Module, query: torch.Tensor, mask: Any, dropout: float,
                        scaling: float | None, kwargs: dict[str, Any]) -> None:
    name = type(module).__name__
    problems = []
    if mask is not None:
        problems.append("an attention mask")
    if not getattr(module, "is_causal", True):
        problems.append("non-causal attention")
    if dropout:
        problems.append(f"attention dropout {dropout}")
    if scaling is not None and not math.isclose(scaling, query.shape[-1] ** -0.5, rel_tol=1e-6):
        problems.append(f"scores scaled by {scaling}, not 1/sqrt(head_dim)")
    if kwargs.get("sliding_window"):
        problems.append(f"a sliding window of {kwargs['sliding_window']}")
    if kwargs.get("softcap"):
        problems.append("logit soft-capping")
    if problems:
        from shardwise.errors import UserError

        raise UserError(f"context parallel runs plain causal attention, but {name} uses "
                        f"{', '.join(problems)}. Use parallel.cp = 1 for this model, or a config "
                        "without it (e.g. attention_dropout = 0).")


def check_context_parallel(config: Any) -> None:
    """Before launch: a config whose attention is not plain causal attention (dropout, a
    sliding window, soft-capping) cannot take context parallel; refused here, by name, rather
    than from inside a worker's first forward."""
    problems = []
    for field in ("attention_dropout", "attn_pdrop"):
        if float(getattr(config, field, 0.0) or 0.0) > 0:
            problems.append(f"{field} = {getattr(config, field)}")
    window, windowed = hf_sliding_window(lambda key: getattr(config, key, None),
                                         int(getattr(config, "num_hidden_layers", 0) or 0))
    if windowed:
        problems.append(f"sliding_window = {window}")
    if getattr(config, "attn_logit_softcapping", None):
        problems.append(f"attn_logit_softcapping = {config.attn_logit_softcapping}")
    if problems:
        from shardwise.errors import UserError

        raise UserError(f"context parallel runs plain causal attention, but the model's config "
                        f"has {', '.join(problems)}. Use parallel.cp = 1, or set those to 0 / "
                        "none in model.hf_config.")
