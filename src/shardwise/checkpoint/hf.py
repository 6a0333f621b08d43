"""Hugging Face weights in and out.

In: `load_pretrained` reads `model.hf_path`'s safetensors straight into the model after the
layout is applied — through DCP's Hugging Face reader, so each rank reads only the slices of the
tensors it holds (FSDP shards, TP shards, its pipeline stages), cast into the fp32 masters. A
tied group is one tensor: it is loaded once, under whichever of its names the file holds.

Out: `export_hf` writes what `AutoModelForCausalLM.from_pretrained(DIR)` loads: config.json,
model.safetensors (one tensor per tied group, in the source dtype unless another is asked for)
and the tokenizer files.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from shardwise.checkpoint.state import ModelState
from shardwise.errors import UserError
from shardwise.models.hf.weights import stored_dtype, tensor_shapes
from shardwise.models.plan import find_tied
from shardwise.spec.model import HfFields

if TYPE_CHECKING:  # the `hf` extra
    from transformers import PretrainedConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def load_pretrained(parts: list[nn.Module], model: HfFields, root: Path,
                    distributed: bool) -> int:
    """Load `root`'s weights into this rank's parts (collective when `distributed`); returns the
    number of tensors loaded. A tensor the file lacks, or holds with another shape, is a
    UserError naming it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    state = ModelState(parts).state_dict()
    present = tensor_shapes(root)  # checked headers: a damaged file is a UserError
    tied = [g for part in parts for g in find_tied(part)]
    wanted = _names_to_load(state, present, tied)
    missing = [n for n in wanted if n not in present]
    if missing:
        raise UserError(f"model.hf_path {root} lacks {len(missing)} of the model's tensors "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): its "
                        "weights are not this model's. Check that config.json matches the "
                        "safetensors (both from the same save_pretrained).")
    # a DTensor's .shape is its global shape, what the file holds
    bad = [f"{n} {present[n]} vs {list(state[n].shape)}" for n in wanted
           if list(state[n].shape) != present[n]]
    if bad:
        raise UserError(f"model.hf_path {root}: tensor shapes differ from the model's "
                        f"({'; '.join(bad[:3])}). The config does not match the weights.")
    to_load = {n: state[n] for n in wanted}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(str(root)),
                 no_dist=not distributed)
    return len(to_load)


def _names_to_load(state: dict[str, Any], present: dict[str, list[int]],
                   tied: list[tuple[str, ...]]) -> list[str]:
    skip: set[str] = set()
    for group in tied:
        held = [n for n in group if n in state]
        keep = next((n for n in held if n in present), held[0] if held else None)
        skip.update(n for n in held if n != keep)
    return [n for n in state if n not in skip]


def export_hf(model: nn.Module, out_dir: Path, model_section: HfFields,
              tokenizer_path: Path | None, dtype: str = "") -> Path:
    """Write `model` (an `HFCausalLM` with full, consolidated tensors) as a save_pretrained
    directory; `dtype` "" keeps the source dtype (fp32 for a model trained from a config)."""
    from safetensors.torch import save_file

    source = stored_dtype(Path(model_section.hf_path).expanduser()) if model_section.hf_path \
        else "float32"
    name = dtype or source
    if name not in DTYPES:
        raise UserError(f"--dtype {name!r} is not one of {', '.join(DTYPES)}.")
    target = DTYPES[name]
    out_dir.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    copies = {n for g in find_tied(model) for n in g[1:]}
    tensors = {k: v.detach().to(target).contiguous() for k, v in state.items()
               if k not in copies}
    model_file = out_dir / "model.safetensors"
    save_file(tensors, str(model_file), metadata={"format": "pt"})
    # (set with object.__setattr__ by HFCausalLM: nn.Module's typing sees a tensor or module)
    config = cast("PretrainedConfig", copy.deepcopy(model.hf_config))
    config.dtype = name  # what from_pretrained reads as the stored dtype
    config.use_cache = True
    config._attn_implementation = None  # shardwise's attention hook is not the reader's
    config.to_json_file(str(out_dir / "config.json"))
    _copy_tokenizer(model_section, tokenizer_path, out_dir)
    return model_file


def _copy_tokenizer(model: HfFields, tokenizer_path: Path | None, out_dir: Path) -> None:
    """The source directory's tokenizer files when fine-tuning; else the run's tokenizer.json."""
    src = Path(model.hf_path).expanduser() if model.hf_path else None
    copied = False
    if src is not None:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out_dir / name)  # mode: the umask's
                copied = True
    if not copied and tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, out_dir / "tokenizer.json")
        from shardwise.data.tokenizer import EOS

        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}))
