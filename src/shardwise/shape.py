"""`ModelShape`: the one torch-free description of a model's shape, and the vocabulary every other
view of a model is converted from.

Every model declares one in its plan (`ModelPlan.shape`, `shardwise.models.plan`); the other
views are derived from it by named conversions, never copied field by field:

- `GPTConfig.shape(params)` / `MoEConfig.shape(params)` (`shardwise.models`): the built-in
  families' config as a shape; a Hugging Face model's comes from its config
  (`shardwise.models.hf.plan`);
- `FlopCounts.of(shape)` (`shardwise.telemetry.flops`): what the FLOPs / MFU formula reads, for a
  decoder of SwiGLU blocks (the built-in families);
- `ModelDims.from_shape(shape, name)` (`shardwise.planner.models`): the planner's wider view
  (tied embeddings, gated FFN, MoE routing, what the plan supports).

The spec's `[model]` section (`shardwise.spec.model`) is what a person writes, not a shape: it
becomes a family's config where the model is built (`GPTConfig.from_fields`). A leaf module: no
torch, and importable from every layer. `hf_sliding_window` lives here because the planner (which
reads a config.json and may not import `models/`) and the Hugging Face family (a loaded config)
must read a config's window by one rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "hf_sliding_window"]


@dataclass(frozen=True)
class ModelShape:
    """What FLOPs, memory estimates and layout checks need, without torch. Zero means "does not
    apply" (a vision model has no heads, no vocabulary)."""

    params: int
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    vocab: int = 0
    seq_len: int = 0
    experts: int = 0  # routed experts per MoE layer (ffn is then one expert's width)
    top_k: int = 0  # routed experts a token uses
    shared_experts: int = 0  # experts every token uses
    window: int = 0  # sliding-window attention: a query sees the last `window` tokens (0: none)
    window_layers: int = 0  # how many of the blocks attend within `window` (the rest: causal)

    @property
    def head_dim(self) -> int:
        """The width of one attention head (hidden / heads; 0 without heads)."""
        return self.hidden // self.heads if self.heads else 0


# the names Hugging Face's `layer_types` gives a block that attends within `sliding_window`
_WINDOWED_TYPES = ("sliding_attention", "local_attention")


def hf_sliding_window(get: Callable[[str], Any], layers: int) -> tuple[int, int]:
    """(window, blocks that use it) from a Hugging Face config read through `get` (a key's value
    or None), for the planner (a config.json) and the Hugging Face family (a loaded config) alike.

    The conventions, in the order transformers resolves them: an explicit `layer_types` list
    (GPT-OSS, Gemma 3, recent Qwen and Mistral configs); `use_sliding_window = false` (Qwen2/3's
    default) turns the window off; Gemma 3's `sliding_window_pattern` (every n-th block global),
    Gemma 2's alternation (even blocks windowed), Qwen2's `max_window_layers` (blocks from that
    index on windowed); otherwise every block (Mistral, Phi-3, Starcoder2). (0, 0) without a
    window."""
    window = get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0 or layers <= 0:
        return 0, 0
    types = get("layer_types")
    if isinstance(types, (list, tuple)) and types:
        return window, sum(1 for t in types[:layers] if t in _WINDOWED_TYPES)
    if get("use_sliding_window") is False:
        return 0, 0
    pattern = get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        return window, layers - layers // pattern
    if get("model_type") == "gemma2":
        return window, (layers + 1) // 2
    first = get("max_window_layers")
    if isinstance(first, int) and not isinstance(first, bool) and get("model_type") in (
            "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        return window, max(layers - first, 0)
    return window, layers
