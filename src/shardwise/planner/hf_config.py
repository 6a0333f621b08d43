"""The planner's view of a Hugging Face model from its `config.json` alone — no torch, no
transformers: `dims_from_hf_config(path)` -> `ModelDims`, for `shardwise plan --model CONFIG`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.planner.models import ModelDims

HF_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def dims_from_hf_config(path: str | Path) -> ModelDims:
    """`ModelDims` from a Hugging Face `config.json` (the usual keys; no transformers): layers,
    hidden size, heads, KV heads, FFN, vocabulary, tied embeddings (Hugging Face's default:
    tied), head_dim, MoE (`num_experts` / `n_routed_experts` / `num_local_experts`,
    `num_experts_per_tok`, `moe_intermediate_size`, `n_shared_experts` or
    `shared_expert_intermediate_size`, `first_k_dense_replace`) and DeepSeek's MLA ranks."""
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
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal config: plan its language model

    def get(key: str, default: Any = None, *, required: bool = False, minimum: int = 1) -> Any:
        value = config.get(key, default)
        if value is None:
            if required:
                raise SpecError(f"{path} has no {key!r}; a Hugging Face config.json of a "
                                "decoder-only transformer states num_hidden_layers, hidden_size, "
                                "num_attention_heads, intermediate_size and vocab_size.")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SpecError(f"{path}: {key} = {show(value)} must be a whole number of at least "
                            f"{minimum}.")
        return value

    layers = get("num_hidden_layers", required=True)
    hidden = get("hidden_size", required=True)
    heads = get("num_attention_heads", required=True)
    kv = get("num_key_value_heads", heads)
    vocab = get("vocab_size", required=True)
    tied = config.get("tie_word_embeddings", True)
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
    ffn = get("intermediate_size", required=not experts or moe_ffn is None)
    if experts and not moe_ffn:  # Mixtral: intermediate_size is the expert width, no dense FFN
        moe_ffn, ffn = ffn, 0
    shared = get("n_shared_experts", 0, minimum=0) if experts else 0
    shared_width = get("shared_expert_intermediate_size", 0, minimum=0) if experts else 0
    if experts and shared_width and not shared:
        shared = max(1, round(shared_width / moe_ffn))
    dense_layers = get("first_k_dense_replace", 0, minimum=0) if experts else 0
    head_dim = get("head_dim", 0, minimum=0)
    attn = 0
    note = ""
    if config.get("kv_lora_rank"):  # DeepSeek multi-head latent attention
        q_rank = get("q_lora_rank", 0, minimum=0)
        kv_rank = get("kv_lora_rank")
        nope, rope = get("qk_nope_head_dim", 128), get("qk_rope_head_dim", 64)
        v = get("v_head_dim", 128)
        q = hidden * q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        attn = q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v) + heads * v * hidden
        head_dim, kv = (nope + rope + v) // 2, heads
        note = "MLA approximated as MHA (heads of the mean q/k and v width), weights exact"
    max_pos = get("max_position_embeddings", 0, minimum=0)
    dims = ModelDims(name=path.parent.name or path.stem, layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv, ffn=ffn or 0, vocab=vocab, seq_len=min(max_pos or 4096, 8192),
                     tied=tied, head_dim=head_dim, experts=experts, top_k=top_k,
                     shared_experts=shared, expert_ffn=moe_ffn or 0,
                     dense_layers=min(dense_layers, layers), attn_params=attn, note=note,
                     source=str(path))
    if dims.moe and dims.dense_layers and not dims.ffn:
        raise SpecError(f"{path}: first_k_dense_replace = {dense_layers} dense blocks need "
                        "intermediate_size (their FFN width).")
    return dims
