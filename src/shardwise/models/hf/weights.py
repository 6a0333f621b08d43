"""The safetensors files of `model.hf_path`, headers read and checked before any worker starts.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype,
shape, byte offsets into the data that follows), then the data. A damaged or truncated file
would otherwise fail deep inside a worker's load (or, with a length field of garbage, try to
read exabytes); here it is one message naming the file.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

from shardwise.errors import UserError

MAX_HEADER = 100 * 2**20  # the format's own bound on the header's length
METADATA = "__metadata__"
#: bytes per element of the dtypes transformers writes (others are checked for offsets only)
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def weight_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.safetensors"))


def read_header(file: Path) -> dict[str, Any]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of `file` (without `__metadata__`),
    checked against the file's size; a UserError naming the file when it is not valid."""
    stat = file.stat()
    return _read_header(file.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _read_header(file: Path, size: int, _mtime_ns: int) -> dict[str, Any]:
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _invalid(file, f"it has {size} bytes, fewer than a header")
        length = int.from_bytes(head, "little")
        if length > min(MAX_HEADER, size - 8):
            raise _invalid(file, f"its header claims {length:,} bytes, but the file has {size:,}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise _invalid(file, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _invalid(file, "its header is not a table of tensors")
    data = size - 8 - length
    tensors = {name: entry for name, entry in header.items() if name != METADATA}
    for name, entry in tensors.items():
        problem = _entry_problem(entry, data)
        if problem:
            raise _invalid(file, f"tensor {name!r} {problem}")
    return tensors


def _entry_problem(entry: Any, data: int) -> str:
    """What is wrong with one tensor's header entry ("" when nothing)."""
    if not isinstance(entry, dict):
        return "has no dtype, shape and offsets"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return f"has dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        return f"has shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        return f"has data offsets {offsets!r}"
    if offsets[1] > data:
        return "ends beyond the end of the file: the file is truncated"
    width = ITEM_BYTES.get(dtype)
    if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
        return (f"holds {offsets[1] - offsets[0]} bytes, not the {math.prod(shape) * width} a "
                f"{dtype} tensor of shape {shape} needs")
    return ""


def _invalid(file: Path, problem: str) -> UserError:
    return UserError(f"model.hf_path: {file} is not a valid safetensors file: {problem}. Copy it "
                     "again if it was damaged or cut short, or re-save the model with "
                     "save_pretrained(DIR, safe_serialization=True).")


def check_weights(root: Path) -> None:
    """Every safetensors file of `root` has a valid header (cached: cheap to call again)."""
    for file in weight_files(root):
        read_header(file)


def tensor_shapes(root: Path) -> dict[str, list[int]]:
    """Tensor name -> shape over every safetensors file of `root` (headers only)."""
    return {name: entry["shape"] for file in weight_files(root)
            for name, entry in read_header(file).items()}


def stored_dtype(root: Path) -> str:
    """The dtype the weights in `root` are stored in (the first tensor's; "float32" when there
    are none)."""
    for file in weight_files(root):
        for entry in read_header(file).values():
            return _DTYPES.get(entry["dtype"], entry["dtype"].lower())
    return "float32"


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
