"""Build a model from the spec's family: the built-in GPT, a user's `py:FILE:FUNCTION`, or a name
an installed package registers (entry point group `shardwise.models`).

A user builder is `build(args: dict, vocab_size: int) -> nn.Module` (or `(module, plan)`): `args`
is the spec's `model.args` table, `vocab_size` the tokenizer's (0 for non-text data). It runs on
every rank with the torch RNG seeded from `run.seed`, so every rank starts from the same weights.

`build_deferred` runs the same builder on the meta device and records its init
(`shardwise.models.deferred`), so each rank later materialises only the tensors it keeps.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.compat import TorchPatches
from shardwise.errors import UserError
from shardwise.models.deferred import CannotDefer, InitRecord, record_build
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.moe import build_moe_gpt
from shardwise.models.plan import ModelPlan, PlanError, attach_plan, plan_of
from shardwise.spec.model import GptFields, HfFields, ModelSection, MoeGptFields
from shardwise.utils.pyfile import failure_text, file_sha256, load_function

ENTRY_POINTS = "shardwise.models"
BUILT_IN = ("gpt", "moe-gpt", "hf")
EXAMPLE = "py:models/mlp.py:build"
Builder = Callable[..., Any]


def build_model(model: ModelSection, vocab_size: int, seq_len: int, seed: int,
                device: torch.device | str | None = None) -> nn.Module:
    """The full model, initialised from `seed` alone so every rank starts from the same weights
    (on `device`; "meta" builds the structure without memory, to read its plan)."""
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        return _construct(model, vocab_size, seq_len)


def _construct(model: ModelSection, vocab_size: int, seq_len: int) -> nn.Module:
    """The family's builder, given the family's own fields (`spec.model.FAMILY_FIELDS`)."""
    fields = model.fields
    if isinstance(fields, MoeGptFields):  # (before GptFields: it is one)
        return build_moe_gpt(fields, vocab_size=vocab_size, seq_len=seq_len)
    if isinstance(fields, GptFields):
        return GPT(GPTConfig.from_fields(fields, vocab_size=vocab_size, seq_len=seq_len))
    if isinstance(fields, HfFields):
        from shardwise.models.hf.build import build_hf  # transformers only when asked for

        return build_hf(fields, vocab_size, seq_len)
    return _build_user(model, vocab_size)


def build_deferred(model: ModelSection, vocab_size: int, seq_len: int, seed: int,
                   patches: TorchPatches | None = None) -> tuple[nn.Module, InitRecord]:
    """The model on the meta device and the record of its init (`model.init = "meta"`): the
    same values as `build_model` once materialised. A build that cannot be recorded faithfully
    is built eagerly instead; the record then says why (`record.fallback`). With
    `model.init = "eager"`, `build_model`'s model and a record that defers nothing. `patches`:
    the runtime's torch patches, through which the recording build makes its one change."""
    if model.init == "eager":
        return build_model(model, vocab_size, seq_len, seed), InitRecord.eager()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            built, record = record_build(lambda: _construct(model, vocab_size, seq_len), patches)
        if record.deferred:
            return built, record
        reason = ""
    except CannotDefer as err:
        reason = str(err)
    except Exception as err:  # the eager build says whether this is the builder's own error
        reason = f"{type(err).__name__} on the meta device: {err}"
    return build_model(model, vocab_size, seq_len, seed), InitRecord.eager(reason or "")


def describe_model(model: ModelSection, vocab_size: int, seq_len: int) -> ModelPlan:
    """The model's plan, from a build on the meta device (no memory, no real init): what the
    launcher checks a layout against before any worker starts. A plan that contradicts its
    model, a builder or a plan method of the user's that fails, or a model with an empty
    parameter (a width of 0 somewhere) is a UserError naming the model."""
    with warnings.catch_warnings():  # an empty parameter is refused below, in words
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        built = build_model(model, vocab_size, seq_len, seed=0, device="meta")
    try:
        plan = plan_of(built)
    except PlanError as err:
        raise UserError(f"model.family = {model.family!r}: {err}") from None
    except Exception as err:
        if model.family in BUILT_IN:
            raise  # shardwise's own model: a bug, with its traceback
        declare = getattr(type(built), "shardwise_plan", None)
        raise UserError(f"model.family = {model.family!r}: the model's shardwise_plan() failed "
                        f"with {failure_text(err, declare)}. Fix the plan method, or model.args "
                        "if the plan is computed from them.") from None
    check_parameters(model, built)
    return plan


def check_parameters(model: ModelSection, built: nn.Module) -> None:
    """A model to train has parameters, none of them empty: a size of 0 (a width, a head count,
    a layer count) builds fine and then fails in every worker."""
    empty = [(name, tuple(p.shape)) for name, p in built.named_parameters() if p.numel() == 0]
    described = _described_by(model)
    if empty:
        name, shape = empty[0]
        raise UserError(f"model.family = {model.family!r}: parameter {name} has shape {shape}, "
                        f"no elements ({len(empty)} empty parameter{'s' if len(empty) > 1 else ''}"
                        f" in all): a size of 0 in {described}? Every width, head count and "
                        "layer count must be at least 1.")
    if not any(True for _ in built.parameters()):
        raise UserError(f"model.family = {model.family!r} built a model with no parameters: "
                        f"nothing to train. Check {described}.")


def _described_by(model: ModelSection) -> str:
    """Where the sizes of `model` come from, for a message."""
    if model.family == "hf":
        return "model.hf_config or model.hf_path's config.json"
    return "model.args" if model.family not in BUILT_IN else f"the [model] keys of {model.family!r}"


def _build_user(model: ModelSection, vocab_size: int) -> nn.Module:
    builder = load_builder(model.family)
    try:
        built = builder(dict(model.args), vocab_size)
    except UserError:
        raise
    except Exception as err:  # the user's code: any failure is theirs (a negative width, say)
        fix = (f"Check model.args ({dict(model.args)}) against what the builder accepts."
               if "meta" not in str(err) else
               "The builder must also build on the meta device, where shardwise reads the model's "
               "plan before any worker starts: make tensors with torch's factories and read no "
               "tensor's values while building.")
        raise UserError(f"model.family = {model.family!r}: the builder failed with "
                        f"{failure_text(err, builder)}. {fix}") from None
    plan = None
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[1], ModelPlan):
        built, plan = built
    if not isinstance(built, nn.Module):
        raise UserError(f"model.family = {model.family!r}: the builder returned "
                        f"{type(built).__name__}; it must return an nn.Module (or a pair "
                        "(module, ModelPlan)).")
    return attach_plan(built, plan) if plan is not None else built


def load_builder(family: str) -> Builder:
    """The builder function `family` names (`py:FILE:FUNCTION` or a registered name)."""
    if family.startswith("py:"):
        builder = load_function(family, "model.family", EXAMPLE, "build(args, vocab_size)")
    else:
        found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)
                 if ep.name == family]
        if not found:
            raise UserError(f"model.family = {family!r} is none of \"gpt\", \"moe-gpt\", \"hf\", "
                            "a \"py:FILE:FUNCTION\" builder, or a name an installed package "
                            f"registers under the {ENTRY_POINTS!r} entry points.")
        builder = found[0].load()
    params = [p for p in inspect.signature(builder).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) > 2:
        raise UserError(f"model.family = {family!r}: the builder takes {len(params)} required "
                        "arguments; it must take (args, vocab_size).")
    return builder


def model_source(family: str, model: ModelSection | None = None) -> dict[str, Any]:
    """What pins the model's code for the manifest: the file's SHA-256, or the package version."""
    if family in ("gpt", "moe-gpt"):
        from shardwise.meta import __version__

        return {"family": family, "shardwise": __version__}
    if family.startswith("py:"):
        return {"family": family, **file_sha256(family, "model.family", EXAMPLE)}
    if family == "hf":
        from shardwise.models.hf.source import hf_source

        return hf_source(model.hf) if model is not None and model.hf is not None \
            else {"family": family}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name == family and ep.dist is not None:
            return {"family": family, "package": ep.dist.name, "version": ep.dist.version}
    return {"family": family}
