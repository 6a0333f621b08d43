"""What a collective call moves, read from its arguments; and whether it returned Work handles.

The tap wraps each function of `torch.distributed` in `C10D` and each functional collective (what
DTensor uses) in `FUNCOL`; the tables give, per function, the op label the call is counted under,
how to read its bytes and the tensor whose device it runs on, and where its group argument is.

Bytes are the size of the buffer the collective works on, the convention of nccl-tests' "size":
all-reduce, broadcast, send/recv: the tensor; all-gather: the gathered output; reduce-scatter and
all-to-all: the full input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: (bytes, the tensor whose device the call runs on) of a call, from its arguments
_Extract = Callable[[tuple, dict], tuple[int, torch.Tensor | None]]


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else None


def _one(t: Any) -> tuple[int, torch.Tensor | None]:
    return (t.numel() * t.element_size(), t) if isinstance(t, torch.Tensor) else (0, None)


def _many(ts: Any) -> tuple[int, torch.Tensor | None]:
    ts = ts or ()
    return sum(_nbytes(t) for t in ts), next((t for t in ts if isinstance(t, torch.Tensor)), None)


def _first(name: str = "tensor") -> _Extract:
    return lambda a, k: _one(_arg(a, k, 0, name))


def _second(name: str) -> _Extract:
    return lambda a, k: _one(_arg(a, k, 1, name))


def _list_sum(i: int, name: str) -> _Extract:
    return lambda a, k: _many(_arg(a, k, i, name))


def _gathered(a: tuple, k: dict) -> tuple[int, torch.Tensor | None]:
    return _many(_arg(a, k, 0, "tensor_list"))  # all_gather(tensor_list, tensor): the output


#: torch.distributed functions: name -> (op label, bytes, group position)
C10D: dict[str, tuple[str, _Extract, int]] = {
    "all_reduce": ("all_reduce", _first(), 2),
    "broadcast": ("broadcast", _first(), 2),
    "reduce": ("reduce", _first(), 3),
    "all_gather_into_tensor": ("all_gather", _first("output_tensor"), 2),
    "all_gather_single": ("all_gather", _first("output_tensor"), 2),
    "_all_gather_base": ("all_gather", _first("output_tensor"), 2),
    "all_gather": ("all_gather", _gathered, 2),
    "reduce_scatter_tensor": ("reduce_scatter", _second("input"), 3),
    "reduce_scatter_single": ("reduce_scatter", _second("input"), 3),
    "_reduce_scatter_base": ("reduce_scatter", _second("input"), 3),
    "reduce_scatter": ("reduce_scatter", _list_sum(1, "input_list"), 3),
    "all_to_all_single": ("all_to_all", _second("input"), 4),
    "all_to_all": ("all_to_all", _list_sum(1, "input_tensor_list"), 2),
    "gather": ("gather", _first(), 3),
    "scatter": ("scatter", _first(), 3),
    "send": ("send", _first(), 2),
    "recv": ("recv", _first(), 2),
    "isend": ("send", _first(), 2),
    "irecv": ("recv", _first(), 2),
    "barrier": ("barrier", lambda a, k: (0, None), 0),
}

#: functional collectives (DTensor): name -> (op label, bytes, group position, output multiplier)
FUNCOL: dict[str, tuple[str, _Extract, int, bool]] = {
    "all_reduce": ("all_reduce", _first("self"), 2, False),
    "all_reduce_coalesced": ("all_reduce", _list_sum(0, "self"), 2, False),
    "all_gather_tensor": ("all_gather", _first("self"), 2, True),
    "all_gather_single": ("all_gather", _first("self"), 2, True),
    "all_gather_tensor_autograd": ("all_gather", _first("self"), 2, True),
    "reduce_scatter_tensor": ("reduce_scatter", _first("self"), 3, False),
    "reduce_scatter_single": ("reduce_scatter", _first("self"), 3, False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", _first("self"), 3, False),
    "all_to_all_single": ("all_to_all", _first("self"), 3, False),
    "all_to_all_single_autograd": ("all_to_all", _first("self"), 3, False),
    "broadcast": ("broadcast", _first("self"), 2, False),
    "permute_tensor": ("send", _first("self"), 2, False),
}


def _is_work(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) and hasattr(x, "wait") and hasattr(x, "get_future")


def _works(result: Any) -> list | None:
    """The Work handles of an asynchronous call (None when the call was synchronous)."""
    if result is None or isinstance(result, torch.Tensor):  # the common cases, first
        return None
    if _is_work(result):
        return [result]
    if isinstance(result, list) and result and all(_is_work(w) for w in result):
        return result
    return None


def _storage_key(tensor: torch.Tensor) -> int:
    """A functional result and the views of it that get waited share one storage."""
    return tensor.untyped_storage().data_ptr()
