"""What the planner knows of a model: `ModelDims`, from a preset or from a model's `ModelShape`
(`ModelDims.from_shape`) — no torch, no transformers; from a Hugging Face `config.json` it is
`planner/hf_config.py`.

A `ModelShape` (`shardwise.shape`) is the one torch-free description every model declares; the
planner widens it into `ModelDims` (adding what a shape does not say: tied embeddings, gated FFN,
MoE routing). Parameter counts follow the architecture: per block the attention
projections (q, k, v, o; grouped-query attention shares K/V heads), the FFN (SwiGLU: three
hidden x ffn matrices), two norms; then the embedding, the output projection unless tied, and a
final norm. MoE blocks hold `experts` routed experts of width `expert_ffn` (+ `shared_experts`
always active) and a router; a token uses `top_k` routed experts. `ModelDims.flop_counts` and
`layer_flops` are its conversions to `telemetry.flops.FlopCounts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from shardwise.errors import SpecError
from shardwise.shape import ModelShape
from shardwise.spec.toml import suggest as _suggest
from shardwise.telemetry.flops import FlopCounts


@dataclass(frozen=True)
class ModelDims:
    """A decoder-only transformer as the cost model sees it (zeros: "does not apply"). A model
    with `layers == 0` or `hidden == 0` is opaque: only its parameter count is known, so it is
    planned for data-parallel layouts only, with no activation estimate."""

    name: str
    params_declared: int = 0  # the model's own count (ModelShape.params); 0: computed from below
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0  # dense FFN width (the SwiGLU hidden size)
    vocab: int = 0
    seq_len: int = 0  # the model's context: the default sequence length to plan for
    tied: bool = False  # output projection shares the embedding
    gated: bool = True  # SwiGLU (three FFN matrices) rather than a two-matrix GeLU MLP
    head_dim: int = 0  # 0: hidden // heads
    experts: int = 0  # routed experts per MoE block (0: dense model)
    top_k: int = 0  # routed experts per token
    shared_experts: int = 0  # experts every token uses
    expert_ffn: int = 0  # width of one expert's FFN
    dense_layers: int = 0  # leading blocks with a dense FFN in an MoE model
    moe_every: int = 1  # block i routes when (i + 1) % moe_every == 0 (Llama 4's interleave step)
    attn_params: int = 0  # attention weights per block when not GQA's formula (MLA); 0: formula
    window: int = 0  # sliding-window attention: a query sees the last `window` tokens (0: none)
    window_layers: int = 0  # blocks that attend within `window` (the others: causal over all)
    supports_tp: bool = True  # the model's plan has a tensor-parallel map
    supports_pp: bool = True  # the model's plan has a pipeline cut
    supports_recompute: bool = True  # the model's plan names its blocks
    default_global_batch: int = 0  # sequences per step to plan for when the CLI is not told
    note: str = ""
    source: str = field(default="preset", compare=False)

    def __hash__(self) -> int:  # hashed by every cached cost term: compute it once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                                if f.compare))
            self.__dict__["_hash"] = cached
        return cached

    # --- shape ----------------------------------------------------------------------------
    @property
    def opaque(self) -> bool:
        return self.layers <= 0 or self.hidden <= 0 or self.heads <= 0

    @property
    def hd(self) -> int:
        return self.head_dim or (self.hidden // self.heads if self.heads else 0)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0 and self.top_k > 0

    @property
    def window_share(self) -> float:
        """The share of the blocks whose attention is windowed. Every block is costed at the
        blocks' mean attention: a pipeline stage is not told which blocks it holds windowed."""
        return min(self.window_layers, self.layers) / self.layers \
            if self.window and self.layers > 0 else 0.0

    def is_moe_layer(self, i: int) -> bool:
        return self.moe and i >= self.dense_layers and (i + 1) % max(self.moe_every, 1) == 0

    @cached_property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("moe" if self.is_moe_layer(i) else "dense" for i in range(max(self.layers, 0)))

    # --- parameters per block (weights; norms apart) -----------------------------------------
    @property
    def attention_weights(self) -> int:
        if self.attn_params:
            return self.attn_params
        h, hd = self.hidden, self.hd
        return 2 * h * self.heads * hd + 2 * h * self.kv * hd  # q, o; k, v

    @property
    def _ffn_mats(self) -> int:
        return 3 if self.gated else 2

    @property
    def dense_ffn_weights(self) -> int:
        return self._ffn_mats * self.hidden * self.ffn

    @property
    def expert_weights(self) -> int:
        """One expert's FFN."""
        return self._ffn_mats * self.hidden * self.expert_ffn

    @property
    def router_weights(self) -> int:
        return self.hidden * self.experts if self.moe else 0

    @property
    def norm_weights(self) -> int:
        return 2 * self.hidden

    def layer_params(self, kind: str) -> dict[str, int]:
        """A block's parameters by how they are split: `attn` and `ffn` (tensor parallel),
        `experts` (routed experts: expert parallel x tensor parallel), `replicated` (norms,
        router)."""
        if kind == "moe":
            return {"attn": self.attention_weights, "ffn": self.shared_experts * self.expert_weights,
                    "experts": self.experts * self.expert_weights,
                    "replicated": self.norm_weights + self.router_weights}
        return {"attn": self.attention_weights, "ffn": self.dense_ffn_weights, "experts": 0,
                "replicated": self.norm_weights}

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def output_params(self) -> int:
        """The output projection's own weights (0 when tied: the embedding's are used)."""
        return 0 if self.tied else self.vocab * self.hidden

    @cached_property
    def computed_params(self) -> int:
        if self.opaque:
            return self.params_declared
        blocks = sum(sum(self.layer_params(k).values()) for k in self.layer_kinds)
        return blocks + self.embedding_params + self.output_params + self.hidden

    @property
    def params(self) -> int:
        return self.params_declared or self.computed_params

    @cached_property
    def active_params(self) -> int:
        """Parameters a token uses (MoE: top-k routed + shared experts and the router)."""
        if self.opaque:
            return self.params
        total = self.embedding_params + self.output_params + self.hidden
        for kind in self.layer_kinds:
            p = self.layer_params(kind)
            total += p["attn"] + p["ffn"] + p["replicated"]
            if kind == "moe":
                total += self.top_k * self.expert_weights
        return total

    @property
    def param_scale(self) -> float:
        """declared / computed: a model whose own count differs (biases, extra modules) has its
        per-part counts scaled to its declared total."""
        if self.opaque or not self.params_declared or not self.computed_params:
            return 1.0
        return self.params_declared / self.computed_params

    # --- FLOPs: telemetry.flops' declared formula, per kind of block ---------------------------
    def layer_matmul_params(self, kind: str) -> int:
        """Active matmul weights per token in one block (norms excluded, router included)."""
        if kind == "moe":
            return (self.attention_weights + self.router_weights
                    + (self.top_k + self.shared_experts) * self.expert_weights)
        return self.attention_weights + self.dense_ffn_weights

    def layer_flops(self, kind: str, seq_len: int) -> FlopCounts:
        """One block as `FlopCounts` (n_layers = 1), so that its `per_token()` is that block's
        share of `telemetry.flops`' 6N + 12LHQT/2, and recompute stops before the last
        projection (w2, or the experts' w2)."""
        last = self.hidden * (self.ffn if kind == "dense"
                              else (self.top_k + self.shared_experts) * self.expert_ffn)
        matmul = self.layer_matmul_params(kind)
        return FlopCounts(n_layers=1, layer_matmul_params=matmul, head_matmul_params=0,
                          n_heads=self.heads, head_dim=self.hd, seq_len=seq_len, causal=True,
                          recompute_matmul_params=matmul - last, window=self.window,
                          window_share=self.window_share)

    def head_flops(self, seq_len: int) -> FlopCounts:
        """The output projection (it counts whether tied or not: a d x V matmul either way)."""
        return FlopCounts(n_layers=0, layer_matmul_params=0,
                          head_matmul_params=self.vocab * self.hidden if not self.opaque
                          else self.params, n_heads=max(self.heads, 1), head_dim=max(self.hd, 1),
                          seq_len=seq_len)

    def flop_counts(self, seq_len: int) -> FlopCounts:
        """The whole model as one `FlopCounts` (the MFU numerator): the per-block counts summed;
        an MoE model's blocks differ, so the sum's remainder over `layers` goes to the head term
        (the total is exact)."""
        if self.opaque:
            return self.head_flops(seq_len)
        blocks = sum(self.layer_matmul_params(k) for k in self.layer_kinds)
        per_layer, rest = divmod(blocks, self.layers)
        return FlopCounts(n_layers=self.layers, layer_matmul_params=per_layer,
                          head_matmul_params=self.vocab * self.hidden + rest, n_heads=self.heads,
                          head_dim=self.hd, seq_len=seq_len, causal=True, window=self.window,
                          window_share=self.window_share)

    # --- from the shape vocabulary ------------------------------------------------------------
    @classmethod
    def from_shape(cls, shape: ModelShape, name: str, *, tied: bool = False,
                   supports_tp: bool = True, supports_pp: bool = True,
                   default_global_batch: int = 0) -> ModelDims:
        """The planner's view of a model's shape (`shardwise.shape.ModelShape`, the one shape
        vocabulary), widened by what a shape does not say. A shape's `ffn` is taken as a SwiGLU
        width; a shape with `experts` but no top-k is planned as top-2 (said in the note); experts
        are as wide as `ffn`."""
        note = ""
        experts = int(getattr(shape, "experts", 0) or 0)
        top_k = int(getattr(shape, "top_k", 0) or 0)
        if experts and not top_k:
            note = f"{experts} experts assumed top-2, each of width ffn (the shape says no more)"
        dims = cls(name=name, params_declared=int(shape.params), layers=int(shape.layers or 0),
                   hidden=int(shape.hidden or 0), heads=int(shape.heads or 0),
                   kv_heads=int(shape.kv_heads or 0), ffn=0 if experts else int(shape.ffn or 0),
                   vocab=int(shape.vocab or 0), seq_len=int(shape.seq_len or 0), tied=tied,
                   experts=experts, top_k=(top_k or 2) if experts else 0,
                   shared_experts=int(getattr(shape, "shared_experts", 0) or 0) if experts
                   else 0,
                   expert_ffn=int(shape.ffn or 0) if experts else 0,
                   window=int(getattr(shape, "window", 0) or 0),
                   window_layers=int(getattr(shape, "window_layers", 0) or 0),
                   supports_tp=supports_tp, supports_pp=supports_pp,
                   default_global_batch=default_global_batch, note=note, source="model plan")
        if dims.opaque:
            return dataclasses.replace(dims, supports_tp=False, supports_pp=False,
                                       supports_recompute=False,
                                       note="shape without layers/hidden/heads: data parallel only")
        return dims

    def describe(self) -> str:
        if self.opaque:
            return f"{self.name}: {self.params / 1e9:.3g} B parameters (shape unknown: data parallel only)"
        mlp = "" if self.gated else " (not gated)"
        heads = f"{self.heads} heads / {self.kv} KV"
        if self.head_dim and self.head_dim * self.heads != self.hidden and not self.attn_params:
            heads += f" of width {self.head_dim}"
        if not self.moe:
            ffn = f", FFN {self.ffn}{mlp}"
        else:  # the dense width only where dense blocks use it; the experts' own width
            n_dense = self.layer_kinds.count("dense")
            plural = "s" if n_dense > 1 else ""
            dense = f", FFN {self.ffn}{mlp} in {n_dense} dense block{plural}" \
                if n_dense and self.ffn else ""
            ffn = (f"{dense}, MoE {self.experts} experts of FFN {self.expert_ffn}{mlp} "
                   f"top-{self.top_k}"
                   f"{f' + {self.shared_experts} shared' if self.shared_experts else ''}, "
                   f"{self.active_params / 1e9:.3g} B active")
        if self.window and self.window_layers:
            some = "every block" if self.window_layers >= self.layers \
                else f"{self.window_layers} of {self.layers} blocks"
            heads += f", a sliding window of {self.window} in {some}"
        return (f"{self.name}: {self.params / 1e9:.4g} B parameters, {self.layers} layers, hidden "
                f"{self.hidden}, {heads}, vocab {self.vocab}{', tied' if self.tied else ''}{ffn}")


# --- presets ---------------------------------------------------------------------------------

def _gpt_default() -> ModelDims:
    """The embedded default RunSpec's GPT (the spec's defaults, with the FFN rule of
    `GptFields.ffn_width` the model is built with; a test checks the result against
    `describe_model`'s build on the meta device)."""
    from shardwise.spec.model import GptFields
    from shardwise.spec.training import BatchSection, DataSection

    m, d = GptFields(), DataSection()
    return ModelDims(name="gpt-default", layers=m.n_layers, hidden=m.d_model, heads=m.n_heads,
                     kv_heads=m.n_kv_heads, ffn=m.ffn_width, vocab=d.vocab_size, seq_len=d.seq_len,
                     tied=m.tie_embeddings, default_global_batch=BatchSection().global_batch,
                     note="the default RunSpec's GPT (examples/default.toml)")


# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, Table 3; the released config.json files):
# SwiGLU, GQA with 8 KV heads, vocabulary 128,256, untied output, 8K pre-training context.
# Batch: the 405B pre-training ended at 16M tokens per step (§3.4.1); 4M for the smaller ones is
# a common choice, not from the paper (pass --global-batch-tokens).
def _llama(name: str, layers: int, hidden: int, heads: int, ffn: int, batch_tokens: int) -> ModelDims:
    return ModelDims(name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn=ffn,
                     vocab=128256, seq_len=8192, default_global_batch=batch_tokens // 8192,
                     note="Llama 3 (Meta 2024, Table 3)")


def mla_attention(hidden: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int,
                  v: int) -> tuple[int, int]:
    """Multi-head latent attention (DeepSeek-V2/V3) as the planner holds it: its projection
    weights counted exactly (query LoRA of rank `q_rank`, 0 for a full query projection; KV
    LoRA of rank `kv_rank`; rotary width `rope`, non-rotary `nope`, value width `v`), and a
    head width for MHA of the same score and value FLOPs — the mean of the (nope + rope)-wide
    query/key heads and the v-wide value heads. The compressed KV cache only matters for
    inference; training activations are those of MHA of those widths. Returns (weights per
    block, head width)."""
    qk = nope + rope
    q = hidden * q_rank + q_rank * heads * qk if q_rank else hidden * heads * qk
    weights = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * hidden
    return weights, (qk + v) // 2


# DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, §4.2 and its config.json):
# 61 blocks, hidden 7168, 128 heads; the first 3 blocks dense (FFN 18432), the other 58 MoE with
# 256 routed experts (top-8) + 1 shared, expert FFN 2048; vocabulary 129,280, untied; 671 B
# parameters, ~37 B active (the multi-token-prediction module is left out, as in the 671 B).
# Multi-head latent attention (`mla_attention`: query LoRA rank 1536, KV LoRA rank 512, rotary
# 64): 187,105,280 weights per block, heads of width 160. Batch: 15,360 sequences of 4,096
# tokens (the report's final batch size).
_MLA_PARAMS, _MLA_HEAD = mla_attention(7168, 128, 1536, 512, 128, 64, 128)


def _deepseek_v3() -> ModelDims:
    return ModelDims(name="deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128,
                     head_dim=_MLA_HEAD, ffn=18432, vocab=129280, seq_len=4096, experts=256, top_k=8,
                     shared_experts=1, expert_ffn=2048, dense_layers=3, attn_params=_MLA_PARAMS,
                     default_global_batch=15360,
                     note="DeepSeek-V3-like (MLA approximated as MHA, see planner/models.py)")


PRESETS = {
    "gpt-default": _gpt_default,
    "llama3-8b": lambda: _llama("llama3-8b", 32, 4096, 32, 14336, 4 * 2**20),
    "llama3-70b": lambda: _llama("llama3-70b", 80, 8192, 64, 28672, 4 * 2**20),
    "llama3-405b": lambda: _llama("llama3-405b", 126, 16384, 128, 53248, 16 * 2**20),
    "deepseek-v3": _deepseek_v3,
}


def preset(name: str) -> ModelDims:
    if name not in PRESETS:
        raise SpecError(f"--model {name!r} is not a preset.{_suggest(name, PRESETS)} Presets: "
                        f"{', '.join(PRESETS)}; or pass a RunSpec .toml or a Hugging Face "
                        "config.json.")
    return PRESETS[name]()


def as_dims(model: ModelDims | ModelShape) -> ModelDims:
    """A ModelDims, or one made from a `ModelShape` (`ModelDims.from_shape`)."""
    if isinstance(model, ModelDims):
        return model
    return ModelDims.from_shape(model, name=type(model).__name__)
