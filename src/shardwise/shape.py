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
torch, and importable from every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape"]


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

    @property
    def head_dim(self) -> int:
        """The width of one attention head (hidden / heads; 0 without heads)."""
        return self.hidden // self.heads if self.heads else 0
