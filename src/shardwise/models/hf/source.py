"""What pins a Hugging Face model for the manifest: transformers' version, the config (its
SHA-256), and for `hf_path` every file's SHA-256 and the weights' source dtype."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from shardwise.spec.model import HfFields
from shardwise.utils.files import cache_root, cached_sha256, sha256_file


def hf_source(model: HfFields) -> dict[str, Any]:
    import transformers

    out: dict[str, Any] = {"family": "hf", "transformers": transformers.__version__}
    if model.hf_path:
        root = Path(model.hf_path).expanduser()
        out["hf_path"] = str(root.resolve())
        # remembered by size and time: a 140 GB model directory is read once, not per launch
        cache = cache_root() / "model-hashes.json"
        out["files"] = {f.name: cached_sha256(f, cache) for f in sorted(root.iterdir())
                        if f.is_file()}
        out["source_dtype"] = source_dtype(root)
    elif isinstance(model.hf_config, dict):
        text = json.dumps(model.hf_config, sort_keys=True)
        out["config_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    else:
        path = Path(model.hf_config).expanduser()
        path = path / "config.json" if path.is_dir() else path
        out["config"] = str(path.resolve())
        out["config_sha256"] = sha256_file(path)
    return out


def source_dtype(root: Path) -> str:
    """The dtype the weights in `root` are stored in (the first tensor's, from the safetensors
    header; "float32" when there are none)."""
    for file in sorted(root.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                return _DTYPES.get(entry["dtype"], entry["dtype"].lower())
    return "float32"


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}

