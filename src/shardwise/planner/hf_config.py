"""The planner's view of a Hugging Face model from its `config.json` alone — no torch, no
transformers: `dims_from_hf_config(path)` -> `ModelDims`, for `shardwise plan --model CONFIG`.

Hugging Face's model families name the same quantities differently (GPT-2's `n_layer`/`n_embd`,
OPT's `ffn_dim`, Falcon's `multi_query`) and differ in what they leave implicit (a plain MLP of
4 x hidden, untied embeddings by default for Llama-style classes, tied for GPT-2-style ones), so
the reader goes by `model_type`: the family says whether the MLP is gated (SwiGLU/GeGLU: three
matrices) or plain (two), what an absent `tie_word_embeddings` means, and which key aliases apply.
A family it does not know is read by the common keys, its MLP judged from `hidden_act`, and the
summary line says so. Encoder-decoder and encoder-only models are refused: the planner plans
decoder-only language models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.planner.models import ModelDims, mla_attention
from shardwise.shape import hf_sliding_window

HF_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
MOE_STEP_KEYS = ("interleave_moe_layer_step", "decoder_sparse_step")
#: families whose MoE block adds one shared expert of the experts' width with no key saying so
ONE_SHARED_EXPERT = frozenset({"llama4", "llama4_text"})

#: families whose MLP is two matrices (up, activation, down), with the width when unstated
PLAIN_MLP = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "gpt_neox", "gptj", "codegen", "opt",
                       "bloom", "falcon", "starcoder2", "phi", "mpt", "biogpt", "xglm",
                       "nemotron"})
#: families whose MLP is gated (SwiGLU, GeGLU: gate, up, down)
GATED_MLP = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                       "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "phimoe",
                       "deepseek_v2", "deepseek_v3", "olmo", "olmo2", "olmoe", "granite",
                       "granitemoe", "cohere", "cohere2", "internlm2", "stablelm", "minicpm",
                       "exaone", "glm", "glm4", "dbrx", "jamba", "arcee", "smollm3", "hunyuan",
                       "llama4", "llama4_text", "gpt_oss"})
#: families whose classes default `tie_word_embeddings` to false (PretrainedConfig's default,
#: and so every other family's, is true)
UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
                               "qwen3_moe", "phi3", "phimoe", "gpt_neox", "deepseek_v2",
                               "deepseek_v3", "olmo", "olmo2", "olmoe", "granite", "granitemoe",
                               "internlm2", "stablelm", "exaone", "dbrx", "nemotron", "jamba",
                               "llama4", "llama4_text", "gpt_oss"})
ENCODER_ONLY = frozenset({"bert", "roberta", "xlm-roberta", "deberta", "deberta-v2", "electra",
                          "albert", "distilbert", "camembert", "mpnet", "modernbert", "ernie"})
#: state-space and recurrent families (no attention blocks)
RECURRENT = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv5", "rwkv6", "xlstm",
                       "recurrent_gemma"})
#: families that mix attention with state-space or linear-attention blocks
HYBRID = frozenset({"jamba", "zamba", "zamba2", "bamba", "nemotron_h", "falcon_h1",
                    "granitemoehybrid", "qwen3_next", "lfm2", "minimax", "plamo2"})
#: keys by which a config interleaves non-attention blocks
HYBRID_KEYS = ("attn_layer_period", "layers_block_type", "hybrid_override_pattern",
               "full_attn_idxs")
#: `layer_types` entries that are attention (causal, windowed or chunked)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "local_attention",
                   "chunked_attention", "attention")
#: the common key first, then the families' aliases (Hugging Face's attribute maps)
ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden_size": ("hidden_size", "n_embd", "n_embed", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len",
                                "seq_length"),
}
GATED_ACTS = ("silu", "swish", "swiglu", "geglu")


def dims_from_hf_config(path: str | Path) -> ModelDims:
    """`ModelDims` from a Hugging Face `config.json` (no transformers): layers, hidden size, heads,
    KV heads (`num_key_value_heads`, Falcon's `num_kv_heads` / `n_head_kv` / `multi_query`), FFN
    width and whether it is gated (by `model_type`, see the module docstring), vocabulary, tied
    embeddings, head_dim, MoE (`num_experts` / `n_routed_experts` / `num_local_experts`,
    `num_experts_per_tok`, `moe_intermediate_size`, `n_shared_experts` or
    `shared_expert_intermediate_size`, `first_k_dense_replace`, Llama 4's
    `interleave_moe_layer_step` / Qwen-MoE's `decoder_sparse_step`), a sliding window
    (`shape.hf_sliding_window`) and DeepSeek's MLA ranks."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"model config {path} does not exist (or is not a file). Pass a preset, a "
                        "RunSpec .toml or a Hugging Face config.json.")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise SpecError(f"{path} is not readable JSON: {err}. Pass a Hugging Face config.json.") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path} holds {type(config).__name__}, not a JSON object of config keys.")
    if not _has(config, "num_hidden_layers") and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal config: plan its language model
    family = config.get("model_type") if isinstance(config.get("model_type"), str) else ""
    _refuse_non_decoders(path, config, family)
    notes: list[str] = []

    def get(key: str, default: Any = None, *, required: bool = False, minimum: int = 1) -> Any:
        name = next((k for k in ALIASES.get(key, (key,)) if config.get(k) is not None), key)
        value = config.get(name, default)
        if value is None:
            if required:
                also = ", ".join(repr(a) for a in ALIASES.get(key, ())[1:])
                raise SpecError(
                    f"{path} has no {key!r}{f' (nor {also})' if also else ''}; a Hugging "
                    "Face config.json of a decoder-only transformer states its layers, hidden "
                    "size, attention heads and vocabulary size (and, unless its family's MLP is "
                    f"4 x hidden, the MLP width){f'; its model_type is {family!r}' if family else ''}.")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"{path}: {name} = {show(value)} must be a whole number of at least "
                            f"{minimum}.")
        return value

    layers = get("num_hidden_layers", required=True)
    hidden = get("hidden_size", required=True)
    heads = get("num_attention_heads", required=True)
    kv = get("num_key_value_heads", None) or get("num_kv_heads", None) or get("n_head_kv", None)
    if kv is None and config.get("multi_query") is True:  # Falcon-7B, GPT-BigCode: one K/V head
        kv = 1
    kv = kv or heads
    vocab = get("vocab_size", required=True)
    gated = _gated(config, family, notes)
    tied = config.get("tie_word_embeddings", family not in UNTIED_BY_DEFAULT)
    if not isinstance(tied, bool):
        raise SpecError(f"{path}: tie_word_embeddings = {show(tied)} must be true or false.")
    if heads % kv:
        raise SpecError(f"{path}: num_attention_heads ({heads}) is not a multiple of "
                        f"num_key_value_heads ({kv}).")
    experts = next((get(k) for k in HF_EXPERT_KEYS if config.get(k)), 0) or 0
    top_k = get("num_experts_per_tok", 0, minimum=0) if experts else 0
    if experts and not top_k:
        raise SpecError(f"{path} declares {experts} experts but no num_experts_per_tok (how many "
                        "experts route each token); add it.")
    moe_ffn = get("moe_intermediate_size") if experts else 0
    expansion = config.get("expansion_ratio")  # MPT states its MLP as a multiple of d_model
    if isinstance(expansion, int | float) and not isinstance(expansion, bool) and expansion > 0 \
            and not _has(config, "intermediate_size"):
        ffn = int(expansion * hidden)
    elif not gated and not experts and not _has(config, "intermediate_size"):
        ffn = 4 * hidden  # GPT-2, BLOOM, Falcon, GPT-Neo: the plain MLP's width when unstated
    else:
        ffn = get("intermediate_size", required=not experts or moe_ffn is None)
    if experts and not moe_ffn:
        # Mixtral, Llama 4: intermediate_size is the expert width; Llama 4's dense blocks (those
        # its interleave step leaves) are intermediate_size_mlp wide
        moe_ffn, ffn = ffn, get("intermediate_size_mlp", 0, minimum=0)
    # every moe_every-th block routes (Llama 4 Maverick's interleave_moe_layer_step, Qwen-MoE's
    # decoder_sparse_step); the others have the dense FFN
    moe_every = next((get(k) for k in MOE_STEP_KEYS if config.get(k)), 1) if experts else 1
    if moe_every > 1 and not ffn:
        raise SpecError(f"{path}: with experts in one block of every {moe_every}, the others "
                        "are dense FFN blocks of a width the config does not state "
                        "(intermediate_size_mlp or intermediate_size); add it.")
    only_dense = config.get("mlp_only_layers")
    if experts and isinstance(only_dense, list) and only_dense:
        notes.append(f"mlp_only_layers {only_dense} planned as MoE blocks")
    shared = get("n_shared_experts", 0, minimum=0) if experts else 0
    if experts and not shared and family in ONE_SHARED_EXPERT:
        shared = 1
    shared_width = get("shared_expert_intermediate_size", 0, minimum=0) if experts else 0
    if experts and shared_width and not shared:
        shared = max(1, round(shared_width / moe_ffn))
        if shared * moe_ffn != shared_width:
            notes.append(f"shared expert of width {shared_width} counted as {shared} of {moe_ffn}")
    dense_layers = get("first_k_dense_replace", 0, minimum=0) if experts else 0
    head_dim = get("head_dim", 0, minimum=0)
    attn = 0
    if config.get("kv_lora_rank"):  # DeepSeek multi-head latent attention
        q_rank = get("q_lora_rank", 0, minimum=0)
        kv_rank = get("kv_lora_rank")
        nope, rope = get("qk_nope_head_dim", 128), get("qk_rope_head_dim", 64)
        v = get("v_head_dim", 128)
        attn, head_dim = mla_attention(hidden, heads, q_rank, kv_rank, nope, rope, v)
        kv = heads
        notes.append("MLA approximated as MHA (heads of the mean q/k and v width), weights exact")
    window, windowed = hf_sliding_window(config.get, layers)  # the model line says it
    chunk = config.get("attention_chunk_size")
    if isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0:
        notes.append(f"chunked attention ({chunk} tokens) planned as causal over the sequence")
    max_pos = get("max_position_embeddings", 0, minimum=0)
    dims = ModelDims(name=path.parent.name if path.name == "config.json" and path.parent.name
                     else path.stem, layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv, ffn=ffn or 0, vocab=vocab, seq_len=min(max_pos or 4096, 8192),
                     tied=tied, gated=gated, head_dim=head_dim, experts=experts, top_k=top_k,
                     shared_experts=shared, expert_ffn=moe_ffn or 0,
                     dense_layers=min(dense_layers, layers), moe_every=moe_every,
                     attn_params=attn,
                     window=window if windowed else 0, window_layers=windowed,
                     note="; ".join(notes), source=str(path))
    if dims.moe and dims.dense_layers and not dims.ffn:
        raise SpecError(f"{path}: first_k_dense_replace = {dense_layers} dense blocks need "
                        "intermediate_size (their FFN width).")
    return dims


def _has(config: dict[str, Any], key: str) -> bool:
    return any(config.get(k) is not None for k in ALIASES.get(key, (key,)))


def _refuse_non_decoders(path: Path, config: dict[str, Any], family: str) -> None:
    """Encoder-decoders, encoders, and models whose blocks are not all attention (state-space,
    recurrent, linear-attention hybrids): costed as a transformer decoder their parameters,
    FLOPs and memory would be silently wrong, so they are refused in words."""
    types = config.get("layer_types")
    other = sorted({t for t in types if isinstance(t, str) and t not in ATTENTION_TYPES}) \
        if isinstance(types, list) else []
    hybrid_key = next((k for k in HYBRID_KEYS if config.get(k) is not None), None)
    if config.get("is_encoder_decoder") is True:
        what = ("an encoder-decoder model (is_encoder_decoder = true"
                f"{f', model_type {family!r}' if family else ''})")
    elif family in ENCODER_ONLY:
        what = f"an encoder-only model (model_type {family!r})"
    elif family in RECURRENT:
        what = f"a recurrent or state-space model (model_type {family!r}), not attention"
    elif family in HYBRID or other or hybrid_key:
        why = f"model_type {family!r}" if family in HYBRID else \
            f"layer_types has {', '.join(map(repr, other))}" if other else f"it states {hybrid_key}"
        what = f"a hybrid whose blocks are not all attention ({why})"
    else:
        return
    raise SpecError(f"{path} is {what}; shardwise plan plans decoder-only transformers, every "
                    "block attention and an MLP or experts. Plan such a model, or describe yours "
                    "in a RunSpec (a user model is planned from what it declares).")


def _gated(config: dict[str, Any], family: str, notes: list[str]) -> bool:
    """Whether the MLP is gated: by family; for one the reader does not know, by its activation
    (SiLU-style activations are gated in every family that uses them), said in the notes."""
    if family in GATED_MLP:
        return True
    if family == "starcoder2" and config.get("mlp_type") == "gated":
        return True
    if family in PLAIN_MLP:
        return False
    act = config.get("hidden_act", config.get("hidden_activation", config.get("activation_function")))
    act = act if isinstance(act, str) else ""
    gated = any(a in act.lower() for a in GATED_ACTS) if act else True
    what = f"model_type {family!r}" if family else "no model_type"
    notes.append(f"{what}: MLP taken as {'gated' if gated else 'not gated'}"
                 f"{f' from hidden_act {act!r}' if act else ''}")
    return gated
