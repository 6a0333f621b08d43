"""#26 "tracebacks still reachable" in the model: a user's builder or plan method that raises, a
model with an empty parameter, a Hugging Face config that cannot build (0 heads, a negative size,
an unknown model_type), a damaged safetensors file in model.hf_path. Each reached the user as a
Python traceback (from the launcher, or from every worker); each is now one paragraph (a
UserError: exit 2) that says what to change, raised by the checks made before any worker starts."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from shardwise.errors import UserError
from shardwise.models.registry import describe_model
from shardwise.spec.model import ModelSection
from tests.support.specs import ROOT

CUSTOM_LM = f"py:{ROOT / 'examples' / 'custom_lm.py'}:build"


def _one_paragraph(message: str) -> None:
    assert "\n" not in message and "Traceback" not in message and len(message) < 700, message


# --- a user's builder -------------------------------------------------------------------------
def test_a_builder_that_raises_anything_is_the_users_error():
    """width = -1: torch raises RuntimeError (negative dimension) inside the user's file; before,
    only TypeError/ValueError/KeyError were the user's and this was a traceback."""
    model = ModelSection.of(family=CUSTOM_LM, args={"width": -1, "depth": 2, "heads": 4})
    with pytest.raises(UserError) as caught:
        describe_model(model, 64, 16)
    message = str(caught.value)
    assert "the builder failed with RuntimeError: Trying to create tensor with negative " \
           "dimension -1" in message
    assert "custom_lm.py:" in message and "in __init__" in message  # where, in the user's file
    assert "Check model.args ({'width': -1" in message
    _one_paragraph(message)


def test_a_model_with_an_empty_parameter_is_refused_before_it_fails_in_the_workers():
    """width = 0 builds (every tensor has a 0 in its shape) and then failed in every worker."""
    model = ModelSection.of(family=CUSTOM_LM, args={"width": 0, "depth": 2, "heads": 4})
    with pytest.raises(UserError) as caught:
        describe_model(model, 64, 16)
    assert "parameter embed.weight has shape (64, 0), no elements" in str(caught.value)
    assert "a size of 0 in model.args" in str(caught.value)
    _one_paragraph(str(caught.value))


def test_a_plan_method_that_raises_is_the_users_error(tmp_path):
    builder = tmp_path / "broken_plan.py"
    builder.write_text(
        "from torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, width):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(4, 4)\n"
        "        self.width = width\n\n"
        "    def shardwise_plan(self):\n"
        "        return {'heads': 4 // self.width}\n\n"
        "def build(args, vocab_size):\n"
        "    return Net(args['width'])\n")
    model = ModelSection.of(family=f"py:{builder}:build", args={"width": 0})
    with pytest.raises(UserError) as caught:
        describe_model(model, 64, 16)
    message = str(caught.value)
    assert "shardwise_plan() failed with ZeroDivisionError" in message
    assert f"{builder}:10, in shardwise_plan" in message
    _one_paragraph(message)


# --- Hugging Face configs ---------------------------------------------------------------------
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


def _hf_refusal(**changes) -> str:
    pytest.importorskip("transformers")
    model = ModelSection.of(family="hf", hf_config={**LLAMA, **changes})
    with pytest.raises(UserError) as caught:
        describe_model(model, 64, 16)
    _one_paragraph(str(caught.value))
    return str(caught.value)


@pytest.mark.parametrize(("changes", "needle"), [
    ({"num_attention_heads": 0}, "num_attention_heads = 0 builds no model"),  # ZeroDivisionError
    ({"hidden_size": -64}, "hidden_size = -64 is negative"),  # RuntimeError: negative dimension
    ({"intermediate_size": -5}, "intermediate_size = -5 is negative"),
    ({"num_key_value_heads": 3}, "num_attention_heads = 4 is not a multiple of "
                                 "num_key_value_heads = 3"),  # failed in the workers' forward
    ({"model_type": "lama"}, "model_type = 'lama' is not a model transformers"),
    ({"model_type": "t5"}, "'t5' is a model transformers"),
])
def test_hf_configs_that_cannot_build_are_one_paragraph(changes, needle):
    """Before: a ZeroDivisionError or RuntimeError traceback, or transformers' list of every
    architecture it knows (3,000 characters, 130 lines on a terminal)."""
    assert needle in _hf_refusal(**changes)


def test_an_unknown_model_type_suggests_the_near_names():
    assert "did you mean 'llama'" in _hf_refusal(model_type="lama")


# --- model.hf_path's safetensors --------------------------------------------------------------
def _pretrained(tmp_path: Path) -> Path:
    """A save_pretrained-like folder: config.json and one safetensors file with two tensors."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "pretrained"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": 64}))
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(8, dtype=torch.bfloat16)},
              str(path / "model.safetensors"))
    return path


def _damage(file: Path, how: str) -> None:
    data = file.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    if how == "length":
        file.write_bytes(struct.pack("<Q", 2**62) + data[8:])  # would have read exabytes
    elif how == "json":
        file.write_bytes(data[:8] + b"{" * length + data[8 + length:])
    elif how == "truncated":
        file.write_bytes(data[:-10])


@pytest.mark.parametrize(("how", "needle"), [
    ("length", "its header claims 4,611,686,018,427,387,904 bytes"),
    ("json", "its header is not JSON"),
    ("truncated", "ends beyond the end of the file: the file is truncated"),
])
def test_a_damaged_safetensors_file_is_refused_before_any_worker_reads_it(tmp_path, how, needle):
    """Before: json.loads / int.from_bytes errors (a traceback from the launcher's manifest, or
    from every worker's load), or an attempt to read 2**62 bytes."""
    from shardwise.checkpoint.hf import tensor_shapes  # what each worker's load reads
    from shardwise.models.hf.build import hf_dir  # what preflight checks
    from shardwise.spec.model import HfFields

    path = _pretrained(tmp_path)
    assert hf_dir(HfFields(hf_path=str(path))) == path
    assert tensor_shapes(path) == {"a": [4, 4], "b": [8]}
    _damage(path / "model.safetensors", how)
    for call in (lambda: hf_dir(HfFields(hf_path=str(path))), lambda: tensor_shapes(path)):
        with pytest.raises(UserError) as caught:
            call()
        message = str(caught.value)
        assert f"{path / 'model.safetensors'} is not a valid safetensors file" in message
        assert needle in message and "save_pretrained" in message
        _one_paragraph(message)
