"""A user's dataset of samples of any type (images, feature vectors, graphs...), not token text.

`data.source = "py:FILE.py:FUNCTION"` names `FUNCTION(args) -> SampleData`, with `args` the
spec's `data.args` table. It runs in the launcher and in every worker, so it must return the
same samples each time (the fingerprint is checked). The samples go through the same global-index
sampler, ledger and resume as packed text: sample i of the run is `train[perm(i)]` wherever and
at whatever layout it is read.

    from shardwise.data import SampleData

    def digits(args):
        images, labels = ...                      # any indexable collections
        return SampleData(train=list(zip(images[:1500], labels[:1500])),
                          val=list(zip(images[1500:], labels[1500:])), num_classes=10)

`collate(samples) -> (inputs, targets)` makes one micro-batch; the default stacks the two halves
of (input, target) pairs. The model is called on `inputs`; its outputs and `targets` go to the
plan's loss (cross entropy over the last dimension by default, one target per label, targets
equal to -100 count nothing). `num_classes` is passed to the model builder as its output size and
sets the class-prior baseline the held-out loss is shown against.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any

import numpy as np
import torch

from shardwise.errors import UserError
from shardwise.utils.constants import IGNORE_INDEX
from shardwise.utils.pyfile import load_function

Batch = tuple[torch.Tensor, torch.Tensor]
EXAMPLE = "py:data/digits.py:load"


def stack_pairs(samples: list[Any]) -> Batch:
    """The default collate: (input, target) pairs -> (stacked inputs, stacked targets)."""
    try:
        inputs = torch.stack([torch.as_tensor(s[0]) for s in samples])
        targets = torch.stack([torch.as_tensor(s[1]) for s in samples])
    except (TypeError, IndexError, RuntimeError) as err:
        raise UserError(f"the default collate stacks (input, target) pairs of equal shapes, and "
                        f"could not stack these samples ({type(err).__name__}: {err}). Return "
                        "such pairs from the dataset, or give SampleData a collate function."
                        ) from None
    return inputs, targets.long() if not targets.is_floating_point() else targets


@dataclass(frozen=True)
class SampleData:
    """What a `data.source = "py:..."` function returns (see the module docstring)."""

    train: Sequence[Any]
    val: Sequence[Any]
    collate: Callable[[list[Any]], Batch] = stack_pairs
    num_classes: int = 0  # the model's output size for a classifier; 0 for anything else
    fingerprint: str = ""  # a content hash for the manifest; "" -> hashed from the samples


class CollatedSamples:
    """One split as the loaders read it: `batch(ids)` collates those samples. Every target a
    collate returns is a real target unless it equals the ignore index, so the step's count is
    taken on the device (`targets_per_sample` is None)."""

    targets_per_sample: int | None = None

    def __init__(self, samples: Sequence[Any], collate: Callable[[list[Any]], Batch],
                 name: str) -> None:
        self.samples, self.collate, self.name = samples, collate, name

    def __len__(self) -> int:
        return len(self.samples)

    def batch(self, ids: np.ndarray) -> Batch:
        out = self.collate([self.samples[int(i)] for i in ids])
        if not (isinstance(out, tuple | list) and len(out) == 2
                and all(isinstance(t, torch.Tensor) for t in out)):
            raise UserError(f"the collate function of the {self.name} split returned "
                            f"{type(out).__name__}; it must return a pair of tensors "
                            "(inputs, targets).")
        inputs, targets = out
        if inputs.shape[:1] != (len(ids),) or targets.shape[:1] != (len(ids),):
            raise UserError(f"the collate function of the {self.name} split returned inputs of "
                            f"shape {tuple(inputs.shape)} and targets of shape "
                            f"{tuple(targets.shape)} for {len(ids)} samples; both must have the "
                            "samples along their first dimension.")
        return inputs, targets


def load_sample_data(source: str, args: dict[str, Any]) -> SampleData:
    """Call the dataset function `source` names and check what it returned."""
    fn = load_function(source, "data.source", EXAMPLE, "FUNCTION(args) -> SampleData")
    try:
        data = fn(dict(args))
    except ImportError as err:
        raise UserError(f"data.source = {source!r}: the dataset function needs {err.name or err}, "
                        f"which is not installed ({err}). Install it (for the digits example: "
                        "pip install -e \".[examples]\").") from None
    except Exception as err:  # the user's code: report any failure as theirs, where it happened
        raise UserError(f"data.source = {source!r}: the dataset function failed with "
                        f"{type(err).__name__}: {err} ({_where(err)}). Check data.args "
                        f"({dict(args)}) and the function.") from None
    if not isinstance(data, SampleData):
        raise UserError(f"data.source = {source!r}: the function returned "
                        f"{type(data).__name__}; it must return shardwise.data.SampleData(train=, "
                        "val=, ...).")
    for name in ("train", "val"):
        split = getattr(data, name)
        if not hasattr(split, "__len__") or not hasattr(split, "__getitem__"):
            raise UserError(f"data.source = {source!r}: SampleData.{name} is a "
                            f"{type(split).__name__}; it must be indexable (len() and [i]), e.g. "
                            "a list or a torch Dataset with __len__.")
        if len(split) == 0:
            raise UserError(f"data.source = {source!r}: SampleData.{name} is empty; both splits "
                            "need samples.")
    if not isinstance(data.num_classes, int) or data.num_classes < 0:
        raise UserError(f"data.source = {source!r}: SampleData.num_classes = "
                        f"{data.num_classes!r}; it must be a whole number >= 0 (0 when the "
                        "model is not a classifier).")
    return data


def _where(err: BaseException) -> str:
    """file:line of the innermost frame of the traceback (the line that raised)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f"at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb else "no traceback"


def fingerprint(data: SampleData) -> str:
    """SHA-256 of every sample's content in order, train then val (or the declared one)."""
    if data.fingerprint:
        return data.fingerprint
    h = hashlib.sha256()
    for name in ("train", "val"):
        split = getattr(data, name)
        h.update(f"{name}:{len(split)};".encode())
        for i in range(len(split)):
            _feed(h, split[i], f"{name}[{i}]")
    return h.hexdigest()


def _feed(h: Any, value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, np.ndarray):
        h.update(f"a{value.dtype.str}{value.shape};".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, str | bytes):
        data = value.encode() if isinstance(value, str) else value
        h.update(f"s{len(data)};".encode() + data)
    elif isinstance(value, bool | Number) or value is None:
        h.update(f"n{value!r};".encode())
    elif isinstance(value, tuple | list):
        h.update(f"l{len(value)};".encode())
        for i, v in enumerate(value):
            _feed(h, v, f"{where}[{i}]")
    elif isinstance(value, dict):
        h.update(f"d{len(value)};".encode())
        for k in sorted(value, key=str):
            h.update(f"{k!s};".encode())
            _feed(h, value[k], f"{where}[{k!r}]")
    else:
        raise UserError(f"cannot fingerprint sample {where}, a {type(value).__name__}: shardwise "
                        "hashes tensors, arrays, numbers, strings and lists/tuples/dicts of them. "
                        "Pass SampleData(fingerprint=...) with a hash of your data's version.")


def class_prior_loss(data: SampleData, chunk: int = 512) -> float | None:
    """Cross entropy (nats) of the held-out targets under the training targets' class
    frequencies (add-one smoothed): the loss of a model that ignores its inputs. None when the
    data is not a classification (num_classes = 0). Also checks every target is a class."""
    if data.num_classes <= 0:
        return None
    counts = []
    for name in ("train", "val"):
        split = CollatedSamples(getattr(data, name), data.collate, name)
        total = np.zeros(data.num_classes, dtype=np.float64)
        for start in range(0, len(split), chunk):
            _, targets = split.batch(np.arange(start, min(start + chunk, len(split))))
            t = targets.reshape(-1)
            if t.is_floating_point():
                raise UserError(f"SampleData.num_classes = {data.num_classes} but the {name} "
                                f"targets are {t.dtype}; class targets are integers. Set "
                                "num_classes = 0 for regression targets.")
            t = t[t != IGNORE_INDEX]
            if len(t) and (int(t.min()) < 0 or int(t.max()) >= data.num_classes):
                raise UserError(f"the {name} split has target {int(t.max())} (or "
                                f"{int(t.min())}), outside [0, num_classes = "
                                f"{data.num_classes}). Set SampleData.num_classes to the number "
                                "of classes.")
            total += np.bincount(t.numpy(), minlength=data.num_classes)
        counts.append(total)
    train, val = counts
    if val.sum() == 0:
        return None
    logp = np.log((train + 1) / (train.sum() + data.num_classes))
    loss = float(-(val * logp).sum() / val.sum())
    return loss if math.isfinite(loss) else None
