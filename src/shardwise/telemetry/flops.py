"""Model FLOPs per token, hardware FLOPs under activation recompute, and MFU / HFU.

The declared definition (written into every run's manifest as `flops_formula`):

    model FLOPs / token  = 6·N + 12·L·H·Q·T · ½ (causal attention)
    hardware FLOPs/token = model FLOPs + forward FLOPs of the recomputed blocks
                         = model + 2·N_rec·R + 4·R·H·Q·T · ½       (R = recomputed blocks)
    MFU = (model FLOPs/token × tokens/s) / (devices × peak FLOP/s per device);  HFU likewise

- N counts the weights that take part in a matrix multiply for a token: every block's projections
  plus the output projection. The output projection counts whether or not it is tied to the
  embedding (it is a d×V matmul either way); the embedding lookup is a gather, not a matmul, and
  does not count, nor do norm weights (elementwise). 6 = 2 (forward) + 4 (input and weight
  gradients in backward).
- 12·L·H·Q·T (PaLM, appendix B) is QKᵀ and AV over the full T×T square, forward and backward,
  for H query heads of width Q (grouped-query attention shares K/V heads but still multiplies
  every query head). A causal mask makes half of that square zero; MFU counts only the useful
  half (`causal_halved=True`), as kernels that skip masked blocks do. A block with sliding-window
  attention (a query sees the last w tokens) counts the keys it attends, w - w²/(2T) a query on
  average (`attended_keys`) instead of T/2: T·½ in the formula becomes that for those blocks.
- N_rec is the block weights the recompute actually multiplies: torch's non-reentrant checkpoint
  stops early, once every tensor backward needs is recomputed, so a block's last projection (its
  output feeds only the residual add) is not run again. For GPT, N_rec = N_block - d·ffn (w2).
- MoE: `layer_matmul_params` is the active weights per token (router + the top-k experts'
  projections), so N is the active count; nothing else changes.
- Everything outside matmuls (softmax, norms, RoPE, SwiGLU gating, the loss) is left out, as
  in the usual MFU definitions (and in FlopCounterMode, which counts matmuls only).

`torch.utils.flop_counter.FlopCounterMode` counts attention over the full square (it does not
halve causal attention, and its math-backend decomposition really does compute the full square), so
tests compare the counter against `per_token(causal_halved=False)`.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.shape import ModelShape

FLOPS_FORMULA = (
    "model_flops_per_token = 6*N + 12*L*H*Q*T/2 (causal attention counted once: half the TxT "
    "square; a sliding-window block of window w counts w - w^2/(2T) keys a query instead of "
    "T/2); N = weights in matmuls per token (block projections + output projection, tied or "
    "not; no embedding lookup, no norms; MoE: active weights); hardware_flops_per_token adds the "
    "recomputed forward 2*N_rec*R + 4*R*H*Q*T/2 for R activation-checkpointed blocks (N_rec: "
    "the block weights recompute multiplies again; torch stops before a block's last projection); "
    "MFU = model_flops_per_token * tokens_per_s / (devices * peak_flops); HFU uses hardware FLOPs"
)


@dataclass(frozen=True)
class FlopCounts:
    """The architecture facts FLOPs depend on; a model family reports these in its plan
    (`ModelPlan.flop_counts`): from its shape (`FlopCounts.of`) or counted on its modules."""

    n_layers: int
    layer_matmul_params: int  # per block, active weights (MoE: router + top-k experts)
    head_matmul_params: int  # matmul weights outside the blocks: the output projection
    n_heads: int  # query heads
    head_dim: int
    seq_len: int
    causal: bool = True
    # Weights per block the recompute of a checkpointed block multiplies (None: all). torch's
    # non-reentrant checkpoint stops recomputing once every tensor backward needs is back, so a
    # final projection whose output nothing saves (GPT's w2) is not run again.
    recompute_matmul_params: int | None = None
    window: int = 0  # sliding-window attention's window (0: none)
    window_share: float = 0.0  # the share of the blocks that attend within it

    @classmethod
    def of(cls, shape: ModelShape) -> FlopCounts:
        """The counts of a decoder whose blocks are attention (q, k, v, o; grouped-query K/V
        heads) and a SwiGLU feed-forward (three hidden x ffn matrices), as the built-in families
        are: with `shape.experts`, the feed-forward is a router and experts of width `ffn`, a
        token using `top_k` of them plus the shared ones. The output projection counts tied or
        not; recompute stops before each block's last projection (w2: nothing saves its output
        for backward)."""
        if not (shape.layers and shape.hidden and shape.heads):
            raise ValueError(f"FlopCounts.of needs a shape with layers, hidden and heads: {shape}")
        h, hd = shape.hidden, shape.head_dim
        attention = 2 * h * shape.heads * hd + 2 * h * shape.kv_heads * hd
        if shape.experts:
            router, ffn = h * shape.experts, shape.ffn * (shape.top_k + shape.shared_experts)
        else:
            router, ffn = 0, shape.ffn
        per_layer = attention + router + 3 * h * ffn
        return cls(n_layers=shape.layers, layer_matmul_params=per_layer,
                   head_matmul_params=h * shape.vocab, n_heads=shape.heads, head_dim=hd,
                   seq_len=shape.seq_len, causal=True,
                   recompute_matmul_params=per_layer - h * ffn, window=shape.window,
                   window_share=shape.window_layers / shape.layers if shape.window else 0.0)

    @property
    def matmul_params(self) -> int:
        """N of the 6·N term."""
        return self.n_layers * self.layer_matmul_params + self.head_matmul_params

    def attention(self, layers: int, passes: int, causal_halved: bool) -> float:
        """Score and value matmuls of `layers` blocks per token; passes: 1 forward = 4·H·Q·T,
        forward + backward = 3 passes = 12·H·Q·T (`causal_halved`: the keys a query attends, T/2,
        or fewer in sliding-window blocks, averaged over the blocks)."""
        return 4.0 * passes * layers * self.n_heads * self.head_dim * self.keys(causal_halved)

    def keys(self, causal_halved: bool = True) -> float:
        """Keys a query is multiplied with, averaged over the blocks: the full square's T, or
        under the causal mask T/2 in a causal block and `attended_keys` in a windowed one."""
        if not (causal_halved and self.causal):
            return float(self.seq_len)
        share = self.window_share if self.window else 0.0
        return ((1.0 - share) * self.seq_len / 2
                + share * attended_keys(self.seq_len, self.window))

    def per_token(self, causal_halved: bool = True) -> float:
        """Model FLOPs per token (forward + backward), the MFU numerator."""
        return 6.0 * self.matmul_params + self.attention(self.n_layers, 3, causal_halved)

    def recompute_per_token(self, recomputed_blocks: int, causal_halved: bool = True) -> float:
        """The extra forward of `recomputed_blocks` activation-checkpointed blocks."""
        params = self.layer_matmul_params if self.recompute_matmul_params is None \
            else self.recompute_matmul_params
        return 2.0 * params * recomputed_blocks + self.attention(recomputed_blocks, 1, causal_halved)

    def hardware_per_token(self, recomputed_blocks: int, causal_halved: bool = True) -> float:
        """Hardware FLOPs per token: model FLOPs plus the recomputed forward (the HFU numerator)."""
        return (self.per_token(causal_halved)
                + self.recompute_per_token(recomputed_blocks, causal_halved))


def attended_keys(seq_len: int, window: int) -> float:
    """Keys a query attends under a causal mask within the last `window` tokens, averaged over
    the sequence: the integral of min(x, w) over [0, T] over T = w - w²/(2T), which is T/2 (the
    causal half) once the window spans the sequence; 0 means no window."""
    if window <= 0 or window >= seq_len:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


def recomputed_blocks(mode: str, ac_every: int, n_layers: int) -> int:
    """Blocks whose forward runs twice, by the rule of `parallel.memory.apply_activation_
    checkpointing`: `full` every block, `selective` every block whose index is a multiple of
    `ac_every` (tests check the two agree)."""
    if mode == "full":
        return n_layers
    if mode == "selective":
        return sum(1 for i in range(n_layers) if i % ac_every == 0)
    return 0


def utilization(flops_per_token: float, tokens_per_s: float, devices: int,
                peak_flops: float | None) -> float | None:
    """Achieved FLOP/s per device over peak FLOP/s per device; None without a peak."""
    if not peak_flops or devices < 1:
        return None
    return flops_per_token * tokens_per_s / devices / peak_flops
