"""The `[models.NAME]` tables of a published reference set (`planner/published.py`): a model's
shape in the planner's vocabulary (`ModelDims`), with mixture-of-experts, multi-head latent
attention and sliding-window keys, each checked and refused in words. Imports no torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.errors import SpecError
from shardwise.planner.models import ModelDims, mla_attention

#: a mixture of experts: routed experts, how many a token uses, always-active shared experts of
#: the same width, one expert's FFN width, and the leading blocks that are dense (FFN `ffn`)
MOE_KEYS = ("experts", "top_k", "shared_experts", "expert_ffn", "dense_layers", "moe_every")
#: multi-head latent attention (DeepSeek-V2/V3, `models.mla_attention`); q_lora_rank 0: a full
#: query projection
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
WINDOW_KEYS = ("window", "window_layers")  # sliding-window attention
MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gated", "tied",
              "head_dim", *MOE_KEYS, *MLA_KEYS, *WINDOW_KEYS)


def model_dims(name: str, table: Mapping[str, Any], origin: str) -> ModelDims:
    """`[models.NAME]` of a reference set as `ModelDims`, every key checked (`MODEL_KEYS`)."""
    unknown = [k for k in table if k not in MODEL_KEYS]
    if unknown:
        raise SpecError(f"{origin}: [models.{name}] has unknown keys {unknown}; valid keys: "
                        f"{', '.join(MODEL_KEYS)}.")
    where = f"{origin}: [models.{name}]"
    moe = _moe(table, where)
    # an MoE model whose every block routes has no dense FFN to state
    every_block_routes = bool(moe) and not moe["dense_layers"] and moe["moe_every"] == 1
    needed = ("layers", "hidden", "heads", "vocab") + (() if every_block_routes else ("ffn",))
    missing = [k for k in needed if k not in table]
    if missing:
        raise SpecError(f"{where} does not set {', '.join(missing)}; a model states layers, "
                        "hidden, heads, ffn (the dense FFN width; an MoE model whose every block "
                        "routes may leave it out) and vocab.")
    if every_block_routes and "ffn" in table:
        raise SpecError(f"{where}: ffn = {table['ffn']!r} has no block to apply to: every block "
                        "of this MoE model routes (dense_layers = 0, moe_every = 1), and its "
                        "experts, shared ones included, are expert_ffn wide. Remove ffn, or state "
                        "the dense blocks it sizes (dense_layers leading, or moe_every).")
    sizes = {k: whole(table[k], k, where) for k in needed}
    if moe and moe["moe_every"] > sizes["layers"]:
        raise SpecError(f"{where}: moe_every = {moe['moe_every']} leaves no MoE block of the "
                        f"{sizes['layers']}; state at most layers, or drop the MoE keys for a "
                        "dense model.")
    if moe and moe["dense_layers"] >= sizes["layers"]:
        raise SpecError(f"{where}: dense_layers = {moe['dense_layers']} leaves no MoE block of "
                        f"the {sizes['layers']}; state fewer, or drop the MoE keys for a dense "
                        "model.")
    kv, hd = table.get("kv_heads", 0), table.get("head_dim", 0)
    for key, value in (("kv_heads", kv), ("head_dim", hd)):
        if value:
            whole(value, key, where)
        elif value != 0:
            raise SpecError(f"{where}: {key} = {value!r} must be a whole number (0: the default).")
    if kv and sizes["heads"] % kv:
        raise SpecError(f"{where}: kv_heads = {kv} does not divide heads = {sizes['heads']}.")
    attn = 0
    if any(k in table for k in MLA_KEYS):
        if kv or hd:
            raise SpecError(f"{where}: kv_heads / head_dim do not apply to multi-head latent "
                            f"attention ({', '.join(MLA_KEYS)}); remove them.")
        missing = [k for k in MLA_KEYS[1:] if k not in table]
        if missing:
            raise SpecError(f"{where}: multi-head latent attention needs {', '.join(missing)} "
                            "too (q_lora_rank may be left out: 0, a full query projection).")
        q_rank = table.get("q_lora_rank", 0)
        if q_rank:
            whole(q_rank, "q_lora_rank", where)
        elif q_rank != 0:
            raise SpecError(f"{where}: q_lora_rank = {q_rank!r} must be a whole number (0: a "
                            "full query projection).")
        kv_rank, nope, rope, v = (whole(table[k], k, where) for k in MLA_KEYS[1:])
        attn, hd = mla_attention(sizes["hidden"], sizes["heads"], q_rank, kv_rank, nope, rope, v)
    if not hd and sizes["hidden"] % sizes["heads"]:
        raise SpecError(f"{where}: heads = {sizes['heads']} does not divide hidden = "
                        f"{sizes['hidden']}; state head_dim if the heads are not hidden / heads wide.")
    window, windowed = _window(table, sizes["layers"], where)
    flags = {k: table.get(k, default) for k, default in (("gated", True), ("tied", False))}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise SpecError(f"{where}: {key} = {value!r} must be true or false.")
    return ModelDims(name=name, layers=sizes["layers"], hidden=sizes["hidden"],
                     heads=sizes["heads"], kv_heads=kv, ffn=sizes.get("ffn", 0),
                     vocab=sizes["vocab"], gated=flags["gated"], tied=flags["tied"], head_dim=hd,
                     attn_params=attn, experts=moe.get("experts", 0),
                     top_k=moe.get("top_k", 0), shared_experts=moe.get("shared_experts", 0),
                     expert_ffn=moe.get("expert_ffn", 0), dense_layers=moe.get("dense_layers", 0),
                     moe_every=moe.get("moe_every", 1),
                     window=window, window_layers=windowed, source=origin)


def _window(table: Mapping[str, Any], layers: int, where: str) -> tuple[int, int]:
    """A model's sliding window: `window` tokens in `window_layers` of its blocks (every block
    when left out); (0, 0) without one."""
    if "window" not in table:
        if "window_layers" in table:
            raise SpecError(f"{where}: window_layers = {table['window_layers']!r} needs window "
                            "(the tokens a windowed block's queries see); state it, or remove "
                            "window_layers.")
        return 0, 0
    window = whole(table["window"], "window", where)
    windowed = table.get("window_layers", layers)
    if isinstance(windowed, bool) or not isinstance(windowed, int) or not 1 <= windowed <= layers:
        raise SpecError(f"{where}: window_layers = {windowed!r} must be a whole number from 1 to "
                        f"layers = {layers} (the blocks that attend within the window; leave it "
                        "out for every block).")
    return window, windowed


def _moe(table: Mapping[str, Any], where: str) -> dict[str, int]:
    """A model's mixture-of-experts fields (`MOE_KEYS`), checked; empty for a dense model."""
    if not any(k in table for k in MOE_KEYS):
        return {}
    missing = [k for k in ("experts", "top_k", "expert_ffn") if k not in table]
    if missing:
        raise SpecError(f"{where}: an MoE model states experts, top_k and expert_ffn; "
                        f"{', '.join(missing)} missing.")
    moe = {k: whole(table[k], k, where) for k in ("experts", "top_k", "expert_ffn")}
    for key in ("shared_experts", "dense_layers"):
        value = table.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SpecError(f"{where}: {key} = {value!r} must be a whole number (0: none).")
        moe[key] = value
    every = table.get("moe_every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise SpecError(f"{where}: moe_every = {every!r} must be a whole number of at least 1 "
                        "(block i routes when (i + 1) % moe_every == 0; 1: every block).")
    moe["moe_every"] = every
    if moe["top_k"] > moe["experts"]:
        raise SpecError(f"{where}: top_k = {moe['top_k']} is more than the {moe['experts']} "
                        "experts.")
    return moe


def whole(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where}: {name} = {value!r} must be a whole number of at least 1.")
    return value
