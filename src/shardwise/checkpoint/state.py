"""What a checkpoint holds, as DCP `Stateful`s: the model's parameters under their
fully-qualified names on every layout (`ModelState`), any object with plain-value
state_dict/load_state_dict (`wrap`), the RNG state of a rank; and `full_model_state`, every
parameter gathered whole (tests, export). The checkpointer (`checkpointer.py`) saves and loads
these without knowing their insides."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.parallel.collectives import gather_full


class ModelState(Stateful):
    """Model parameters keyed by their fully-qualified names, merged over this rank's parts
    (pipeline stages keep the whole model's names), as DCP-reshardable (D)Tensors."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            keys = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state[k] for k in keys},
                                 options=StateDictOptions(strict=True))


class _Plain(Stateful):
    """Adapts an object with state_dict/load_state_dict of plain Python values."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


def full_model_state(parts: list[nn.Module], pp_group: dist.ProcessGroup | None = None
                     ) -> dict[str, torch.Tensor]:
    """Every parameter as a full CPU tensor, on every rank; collective. Pipeline stages are
    merged across `pp_group`. Meant for small models (tests, export)."""
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        # (a model's state dict holds tensors: its parameters and buffers)
        merged.update({k: gather_full(cast(torch.Tensor, v)).detach().cpu() for k, v in
                       get_model_state_dict(part).items()})
    if pp_group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, merged, group=pp_group)
        for other in gathered:
            merged.update(other)
    return merged


def wrap(obj: Any) -> Stateful:
    """`obj` as a Stateful (an adapter for plain-value state dicts)."""
    return obj if isinstance(obj, Stateful) else _Plain(obj)


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
