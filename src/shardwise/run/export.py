"""Export a sharded checkpoint as one consolidated safetensors file any tool can load.

The checkpoint is read with DCP in a single process (no process group) — which unpickles the
checkpoint's metadata, so export only checkpoints you trust (docs/security.md) — resharded onto a
freshly built model of the run's spec, and written with safetensors, which holds only tensors: a
reader of the export never unpickles anything. `config.json` (model shape, vocabulary, sequence
length) and the tokenizer are written beside it. Nothing is written into the checkpoint being
read or the weights the run was fine-tuned from (`check_export_target`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint.discovery import Found
from shardwise.checkpoint.integrity import verify
from shardwise.checkpoint.layout import META
from shardwise.errors import UserError
from shardwise.models import build_model
from shardwise.models.plan import plan_of
from shardwise.models.registry import model_source
from shardwise.spec.runspec import RunSpec
from shardwise.utils.paths import is_within


def export_safetensors(checkpoint: Found, out_dir: Path, spec: RunSpec | None) -> Path:
    """Write out_dir/model.safetensors (+ config.json, tokenizer.json); returns the model file.
    `spec`: the run's spec (what `shardwise.run.rundir.load_run_spec` reads from its directory)."""
    from safetensors.torch import save_file

    check_export_target(out_dir, checkpoint, spec)
    model, data, spec = consolidated(checkpoint, spec)
    state = {k: v for k, v in model.state_dict().items()}
    tied = plan_of(model).tied
    copies = {name for group in tied for name in group[1:]}
    # safetensors stores a shared tensor once: one tensor per tied group, under its first name
    tensors = {k: v.detach().contiguous() for k, v in state.items() if k not in copies}
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"vocab_size": data.vocab_size, "seq_len": spec.data.seq_len,
              **spec.model.table(), "tied": [list(g) for g in tied],
              "source": model_source(spec.model.family, spec.model),
              "checkpoint": str(checkpoint.location),
              "step": json.loads((checkpoint.location / META).read_text())["step"]}
    model_file = out_dir / "model.safetensors"
    save_file(tensors, str(model_file), metadata={"format": "pt", "shardwise_config":
                                                  json.dumps(config)})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if data.tokenizer_path is not None:
        shutil.copyfile(data.tokenizer_path, out_dir / "tokenizer.json")  # mode: the umask's
    return model_file


def export_hf_dir(checkpoint: Found, out_dir: Path, spec: RunSpec | None, dtype: str = "") -> Path:
    """Write a `from_pretrained` directory for a run of a Hugging Face model."""
    from shardwise.checkpoint.hf import export_hf

    if spec is not None and spec.model.family != "hf":
        raise UserError(f"--format hf exports Hugging Face models (model.family = \"hf\"); "
                        f"this run's model is {spec.model.family!r}. Use --format safetensors.")
    check_export_target(out_dir, checkpoint, spec)
    model, data, spec = consolidated(checkpoint, spec)
    assert spec.model.hf is not None  # checked above: family "hf"
    return export_hf(model, out_dir, spec.model.hf, data.tokenizer_path, dtype)


def check_export_target(out_dir: Path, checkpoint: Found, spec: RunSpec | None) -> None:
    """Refuse, before anything is written, an output folder that is the run's source weights
    (`model.hf_path`) or the checkpoint being exported, or inside either: the export's
    model.safetensors and config.json would replace the files it reads."""
    sources: list[tuple[str, Path]] = []
    if spec is not None and spec.model.hf is not None and spec.model.hf.hf_path:
        sources.append(("model.hf_path, the weights this run was fine-tuned from",
                        Path(spec.model.hf.hf_path).expanduser()))
    if isinstance(checkpoint.location, Path):
        sources.append(("the checkpoint being exported", checkpoint.location))
    for what, source in sources:
        if is_within(out_dir, source):
            raise UserError(f"the export folder {out_dir} is {what} ({source}), or inside it: "
                            "the export would overwrite the files it reads. Export to another "
                            "folder (--out DIR, or checkpoint.hf_export; the default is "
                            "RUN_DIR/export/step-NNNNNN).")


def consolidated(checkpoint: Found, spec: RunSpec | None) -> tuple[torch.nn.Module, Any, RunSpec]:
    """The run's model, built whole in this process, with the checkpoint's parameters (read with
    DCP without a process group, resharded from whatever layout wrote them)."""
    location = checkpoint.location
    if not (location / META).is_file():
        raise UserError(f"{location} is not a checkpoint (no {META}). Pass a directory like "
                        "runs/NAME/checkpoints/step-000500.")
    verdict = verify(location, 0, 1, False)
    if not verdict.valid:
        raise UserError(f"{location} does not verify: {'; '.join(verdict.problems)}. Export an "
                        "earlier checkpoint instead.")
    if spec is None:
        raise UserError(f"{location} has no run spec beside it ({checkpoint.run_dir} should hold "
                        "spec.toml). Export a checkpoint inside its run directory.")
    from shardwise.data import prepare_data

    data = prepare_data(spec.data)
    model = build_model(spec.model, data.vocab_size, spec.data.seq_len, spec.run.seed)
    state = {k: v for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=checkpoint.reader(), no_dist=True)
    return model, data, spec


def load_exported(model_file: Path) -> tuple[torch.nn.Module, dict]:
    """Rebuild the model from an export (safetensors + config.json), without any pickle."""
    from safetensors.torch import load_file

    from shardwise.spec.load import model_section
    from shardwise.spec.model import fields_class

    config = json.loads((model_file.parent / "config.json").read_text())
    keys = {"family", "init", *fields_class(config.get("family", "gpt")).__dataclass_fields__}
    section = model_section({k: config[k] for k in keys if k in config}, str(model_file))
    model = build_model(section, config["vocab_size"], config["seq_len"], seed=0)
    tensors = load_file(str(model_file))
    for group in config.get("tied", []):
        for name in group[1:]:
            tensors[name] = tensors[group[0]]
    model.load_state_dict(tensors, strict=True)
    return model, config
