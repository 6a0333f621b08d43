"""Build a model from the spec's family: the built-in GPT, a user's `py:FILE:FUNCTION`, or a name
an installed package registers (entry point group `shardwise.models`).

A user builder is `build(args: dict, vocab_size: int) -> nn.Module` (or `(module, plan)`): `args`
is the spec's `model.args` table, `vocab_size` the tokenizer's (0 for non-text data). It runs on
every rank with the torch RNG seeded from `run.seed`, so every rank starts from the same weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.plan import ModelPlan, PlanError, attach_plan, plan_of
from shardwise.spec.runspec import ModelSection

ENTRY_POINTS = "shardwise.models"
Builder = Callable[..., Any]


def build_model(model: ModelSection, vocab_size: int, seq_len: int, seed: int,
                device: torch.device | str | None = None) -> nn.Module:
    """The full model, initialised from `seed` alone so every rank starts from the same weights
    (on `device`; "meta" builds the structure without memory, to read its plan)."""
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(seed)
        if model.family == "gpt":
            return GPT(GPTConfig.from_spec(model, vocab_size=vocab_size, seq_len=seq_len))
        return _build_user(model, vocab_size)


def describe_model(model: ModelSection, vocab_size: int, seq_len: int) -> ModelPlan:
    """The model's plan, from a build on the meta device (no memory, no real init): what the
    launcher checks a layout against before any worker starts. A plan that contradicts its
    model, or a builder that fails, is a UserError naming the model."""
    try:
        return plan_of(build_model(model, vocab_size, seq_len, seed=0, device="meta"))
    except PlanError as err:
        raise UserError(f"model.family = {model.family!r}: {err}") from None


def _build_user(model: ModelSection, vocab_size: int) -> nn.Module:
    builder = load_builder(model.family)
    try:
        built = builder(dict(model.args), vocab_size)
    except (TypeError, ValueError, KeyError) as err:
        raise UserError(f"model.family = {model.family!r}: the builder failed with "
                        f"{type(err).__name__}: {err}. Check model.args ({dict(model.args)}) "
                        "against the builder's parameters.") from None
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
        path, function = _split_py(family)
        module = _import_file(path, family)
        builder = getattr(module, function, None)
        if not callable(builder):
            raise UserError(f"model.family = {family!r}: {path} defines no function "
                            f"{function!r}. Name a function build(args, vocab_size) in that file.")
    else:
        found = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)
                 if ep.name == family]
        if not found:
            raise UserError(f"model.family = {family!r} is neither \"gpt\", a \"py:FILE:FUNCTION\" "
                            f"builder, nor a name an installed package registers under the "
                            f"{ENTRY_POINTS!r} entry points.")
        builder = found[0].load()
    params = [p for p in inspect.signature(builder).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) > 2:
        raise UserError(f"model.family = {family!r}: the builder takes {len(params)} required "
                        "arguments; it must take (args, vocab_size).")
    return builder


def model_source(family: str) -> dict[str, str]:
    """What pins the model's code for the manifest: the file's SHA-256, or the package version."""
    if family == "gpt":
        from shardwise import __version__

        return {"family": family, "shardwise": __version__}
    if family.startswith("py:"):
        path, _ = _split_py(family)
        return {"family": family, "file": str(path),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        if ep.name == family and ep.dist is not None:
            return {"family": family, "package": ep.dist.name, "version": ep.dist.version}
    return {"family": family}


def _split_py(family: str) -> tuple[Path, str]:
    body = family[len("py:"):]
    path, sep, function = body.rpartition(":")
    if not sep or not path or not function:
        raise UserError(f"model.family = {family!r} is not of the form \"py:FILE:FUNCTION\", e.g. "
                        "\"py:models/mlp.py:build\".")
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"model.family = {family!r}: {file} does not exist (paths are relative "
                        "to the directory you run shardwise in). Give the path of a .py file.")
    return file.resolve(), function


def _import_file(path: Path, family: str) -> Any:
    name = "shardwise_user_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"model.family = {family!r}: {path} cannot be imported as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: report any failure as theirs, with its cause
        del sys.modules[name]
        raise UserError(f"model.family = {family!r}: importing {path} failed with "
                        f"{type(err).__name__}: {err}.") from None
    return module
