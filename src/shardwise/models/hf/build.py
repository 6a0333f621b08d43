"""Build a Hugging Face causal LM from `model.hf_config` (random init: pretraining) or
`model.hf_path` (a local directory with config.json and safetensors: fine-tuning), offline.

Nothing is ever downloaded: `hf_path` must be a local directory, a hub id is refused with the
command that downloads it, and transformers runs with HF_HUB_OFFLINE=1. The weights of an
`hf_path` are not read here — the model is built with random init (on the meta device, like any
model), and `shardwise.checkpoint.hf` loads each rank's shards into it after the layout is
applied.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from shardwise.errors import UserError, brief
from shardwise.models.hf.adapter import HFCausalLM
from shardwise.models.hf.attention import install, register
from shardwise.models.hf.config_checks import check_model_type, check_sizes, where_config
from shardwise.models.hf.moe import adapt_moe
from shardwise.models.hf.plan import find_layout, hf_plan
from shardwise.models.hf.weights import check_weights
from shardwise.models.plan import PlanError, attach_plan
from shardwise.spec.model import HfFields

TRANSFORMERS_RANGE = ">=5.0,<6"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def import_transformers() -> Any:
    """transformers, offline and quiet; a one-paragraph error when it is missing or too old."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import transformers
    except ImportError:
        raise UserError("model.family = \"hf\" needs the transformers package: pip install "
                        "\"shardwise[hf]\" (transformers " + TRANSFORMERS_RANGE + ").") from None
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise UserError(f"model.family = \"hf\" supports transformers {TRANSFORMERS_RANGE}; "
                        f"transformers {transformers.__version__} is installed. Install a 5.x "
                        "release: pip install \"shardwise[hf]\".")
    transformers.logging.set_verbosity_error()
    return transformers


def hf_dir(model: HfFields) -> Path | None:
    """The checked local directory of `model.hf_path` (None without one)."""
    if not model.hf_path:
        return None
    path = Path(model.hf_path).expanduser()
    if not path.is_dir():
        if _HUB_ID.fullmatch(model.hf_path) and not path.exists():
            raise UserError(
                f"model.hf_path = {model.hf_path!r} looks like a Hugging Face hub id; shardwise "
                "never downloads. Fetch it once with `huggingface-cli download "
                f"{model.hf_path} --local-dir DIR` (on a machine with network) and set "
                "model.hf_path = DIR.")
        raise UserError(f"model.hf_path = {model.hf_path!r} is not a directory. Point it at a "
                        "folder holding config.json and model.safetensors (what "
                        "save_pretrained writes).")
    if not (path / "config.json").is_file():
        raise UserError(f"model.hf_path = {model.hf_path!r} has no config.json. Point it at the "
                        "folder save_pretrained wrote.")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise UserError(f"model.hf_path = {model.hf_path!r} has no model.safetensors (or "
                        "model.safetensors.index.json). shardwise loads safetensors only, never "
                        "pickled .bin files: convert with save_pretrained(..., "
                        "safe_serialization=True).")
    check_weights(path)  # a damaged header is refused here, before any worker reads it
    return path


def load_config(model: HfFields, vocab_size: int, seq_len: int) -> Any:
    """The model's transformers config: from hf_path, a config file, or a table; with the
    vocabulary the data needs and a check that seq_len fits its positions."""
    transformers = import_transformers()
    where = "model.hf_path" if model.hf_path else "model.hf_config"
    path = hf_dir(model)
    table = dict(_config_table(model.hf_config if path is None else str(path), where))
    model_type = table.pop("model_type", None)
    if not model_type:
        raise UserError(f"{where} has no model_type (e.g. \"llama\", \"qwen3\", \"gpt2\"); a "
                        "config.json from save_pretrained has one.")
    check_model_type(model_type, where)
    check_sizes(table, where)
    try:
        if path is not None:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        else:
            table.setdefault("vocab_size", vocab_size)
            config = transformers.AutoConfig.for_model(model_type, **table)
    except Exception as err:  # the user's config: whatever transformers makes of it is theirs
        raise UserError(f"{where}: transformers cannot read this config ({brief(err)}). Check "
                        "model_type and the field names against the model's config class.") from None
    if vocab_size and config.vocab_size < vocab_size:
        raise UserError(f"{where}: the model's vocab_size ({config.vocab_size}) is smaller than "
                        f"the tokenizer's ({vocab_size}); token ids would fall outside the "
                        "embedding. Raise vocab_size in the config, or use the model's own "
                        "tokenizer (data.tokenizer).")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions",
                                                                             None)
    if positions and seq_len > positions:
        raise UserError(f"data.seq_len ({seq_len}) is longer than the model's "
                        f"{positions} positions (max_position_embeddings / n_positions in "
                        f"{where}). Shorten data.seq_len or raise it in the config.")
    config.use_cache = False
    return config


def _config_table(value: Any, where: str) -> dict[str, Any]:
    """The config as a table: `value` itself, or the JSON of a config.json (or of a folder's)."""
    if isinstance(value, dict):
        return value
    path = Path(str(value)).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"{where} = {value!r} is neither a table nor a config.json file. "
                        "Give a file path, or a table like { model_type = \"llama\", "
                        "hidden_size = 64, ... }.")
    try:
        table = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: {path} is not valid JSON: {err}.") from None
    if not isinstance(table, dict):
        raise UserError(f"{where}: {path} holds a JSON {type(table).__name__}, not the table of "
                        "a config (what save_pretrained writes).")
    return table


def build_hf(model: HfFields, vocab_size: int, seq_len: int) -> nn.Module:
    """The adapted model with its plan attached (random init from the current RNG)."""
    transformers = import_transformers()
    config = load_config(model, vocab_size, seq_len)
    try:
        with _init_on_meta():
            hf = transformers.AutoModelForCausalLM.from_config(config,
                                                               attn_implementation=register())
    except Exception as err:  # the user's config: a size transformers cannot build with
        raise UserError(f"{where_config(model)}: transformers cannot build a causal LM from this "
                        f"config ({brief(err)}). Check its sizes (hidden size, heads, layers) "
                        "against each other.") from None
    hf.float()
    try:
        adapter = HFCausalLM(hf, find_layout(hf))
        adapt_moe(adapter, adapter.layout.base, adapter.layout.blocks, config)
        declared = dict(model.hf_tp_plan) or dict(getattr(hf, "_tp_plan", None) or {})
        object.__setattr__(adapter, "hf_tp_plan", declared)
        plan = hf_plan(adapter, seq_len)
        install([m for name, m in adapter.named_modules()
                 if plan.attention and fnmatch.fnmatchcase(name, plan.attention)])
        return attach_plan(adapter, plan)
    except PlanError as err:
        raise UserError(f"model.family = \"hf\" ({type(hf).__name__}): {err}") from None


@contextlib.contextmanager
def _init_on_meta() -> Iterator[None]:
    """transformers skips its weight init when the model is built on the meta device (nothing to
    fill). shardwise's deferred build records that init instead, so that each rank replays the
    values the eager build gives: transformers is told the build is not on meta, and runs its
    init at the same points, in the same order, drawing the same random numbers."""
    import torch
    from transformers import modeling_utils

    if torch.empty(0).device.type != "meta":
        yield
        return
    original = modeling_utils.get_torch_context_manager_or_global_device
    modeling_utils.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        modeling_utils.get_torch_context_manager_or_global_device = original
