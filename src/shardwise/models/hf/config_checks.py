"""What is checked in a Hugging Face config before transformers sees it: a model_type that names a
causal LM transformers has, and sizes that can build a model. transformers' own errors for these
are a division by zero, a tensor of negative size, or a list of every architecture it knows
(130 lines): here each is one paragraph naming the field."""

from __future__ import annotations

import difflib
import re
from typing import Any

from shardwise.errors import UserError
from shardwise.spec.model import HfFields

#: sizes a model cannot have 0 of (the GPT-2 family's names too)
NONZERO = frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "intermediate_size", "head_dim", "num_key_value_heads", "n_embd", "n_layer",
                     "n_head", "n_inner", "d_model", "ffn_dim", "max_position_embeddings",
                     "n_positions"})
#: a count or a size, by its name: never negative
_SIZE_NAME = re.compile(r"^(num|n)_|_(size|dim|heads|layers|experts|positions|embd|inner|ctx|tok)$")


def where_config(model: HfFields) -> str:
    return "model.hf_path" if model.hf_path else "model.hf_config"


def check_model_type(model_type: Any, where: str) -> None:
    """`model_type` names a model transformers builds with AutoModelForCausalLM."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if model_type in causal:
        return
    close = difflib.get_close_matches(str(model_type), causal, n=3, cutoff=0.6)
    known = (f"a model transformers {__version__} has, but not a causal language model "
             "(AutoModelForCausalLM cannot build it)" if model_type in CONFIG_MAPPING_NAMES
             else f"not a model transformers {__version__} knows")
    raise UserError(
        f"{where}: model_type = {model_type!r} is {known}"
        + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ".")
        + " Name one of its causal LMs (e.g. \"llama\", \"qwen3\", \"gpt2\"); `python -c \"from "
        "transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as m; "
        "print(sorted(m))\"` lists all of them.")


def check_sizes(table: dict[str, Any], where: str) -> None:
    """No count or size in the config's top level is negative, and none that a model needs at
    least one of (hidden size, heads, layers, vocabulary) is 0."""
    for key, value in table.items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if value < 0 and _SIZE_NAME.search(key):
            raise UserError(f"{where}: {key} = {value} is negative; a size or a count is at "
                            "least 0 (and most must be at least 1). Correct it in the config.")
        if value == 0 and key in NONZERO:
            raise UserError(f"{where}: {key} = 0 builds no model; it must be at least 1. Correct "
                            "it in the config.")
    heads, groups = table.get("num_attention_heads"), table.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(groups, int) and groups and heads % groups:
        raise UserError(f"{where}: num_attention_heads = {heads} is not a multiple of "
                        f"num_key_value_heads = {groups}: grouped-query attention shares each "
                        "key/value head among a whole number of query heads. Make "
                        "num_key_value_heads a divisor of num_attention_heads.")
