"""Record a model's build on the meta device: what it did, so that any of its tensors can be
rebuilt on a CPU (`record_build`), or why it cannot be (`CannotDefer`).

**Record.** The builder runs under `torch.device("meta")` inside a dispatch mode that logs every
aten op touching a meta tensor (no memory, no real init). Tensors are identified by their storage
(meta storages have no data pointer, so by the storage object's address, pinned while recording);
every tensor argument is logged as (storage, version, size, stride, offset, dtype), so views need
no logging of their own. An op whose output shares an input's storage is a view or an in-place
op: no new storage. An out-of-place op creates a storage (its creation event); an in-place or
`out=` op appends a write event to each storage it mutates (and bumps its version). For an op that
draws random numbers (`torch.Tag.nondeterministic_seeded`) the CPU generator's state is saved
before it, and the same op is run on a real CPU scratch tensor of the same geometry, so the
generator advances exactly as it would in the eager build; the scratch is one reused buffer
(`_Pool`), so the recording's peak memory is one tensor, not the model.

**Values the builder reads** (`.item()`, `bool(t)`, `.to("cpu")`, the rejection loop of
`trunc_normal_`): the op runs for real on its inputs rebuilt from the record, so the builder sees
the eager build's numbers and takes the same branches (memory: that tensor and its inputs).

**Refused** (the caller builds eagerly instead, and says why): a builder that keeps tensors it
made off the meta device in the model, keeps a meta tensor that is neither a parameter nor a
buffer, or whose final tensors depend on something the record cannot rebuild (a storage made
outside the dispatcher, a resized storage); an op with no meta kernel fails the meta build.

Torch's `nn.init` skips `trunc_normal_`, `orthogonal_`, `dirac_` and `sparse_` on meta tensors
(a no-op there, which would silently skip their random draws): while recording, `Tensor.is_meta`
answers False to `torch.nn.init` and to code outside torch (as it would in the eager build);
torch's other internals see the truth.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from shardwise.compat import (
    TensorBase,
    TorchDispatchMode,
    TorchPatches,
    tree_flatten,
    tree_leaves,
    tree_map,
)
from shardwise.models.deferred.buffers import _Pool, _scratch, _view
from shardwise.models.deferred.record import (
    CannotDefer,
    InitRecord,
    Ref,
    _Call,
    _Const,
    _dense_prefix,
    _Event,
    _extent,
    _Gen,
    _numel,
    _Storage,
)
from shardwise.models.deferred.replay import _Replayer

MAX_DEPTH = 400  # a longer chain of dependent storages is not replayed (recursion)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_INIT_FILE = os.path.join(_TORCH_DIR, "nn", "init.py")
# in-place ops that overwrite every element of `self` without reading it
_OVERWRITES = {"aten::fill_", "aten::zero_", "aten::copy_", "aten::normal_", "aten::uniform_",
               "aten::random_", "aten::exponential_", "aten::log_normal_", "aten::cauchy_",
               "aten::geometric_", "aten::bernoulli_"}
# ops whose non-scalar results depend on metadata only
_METADATA = {"aten::is_same_size", "aten::size", "aten::stride", "aten::numel", "aten::dim",
             "aten::is_contiguous", "aten::sym_size", "aten::sym_stride", "aten::sym_numel",
             "aten::sym_storage_offset"}


class _NeedsValues(BaseException):  # a BaseException: a builder's `except Exception` lets it by
    """Raised inside the builder when it reads a value from a meta tensor."""


def record_build(build: Callable[[], nn.Module], patches: TorchPatches | None = None
                 ) -> tuple[nn.Module, InitRecord]:
    """Run `build()` on the meta device and record how to rebuild its parameters and buffers.
    The torch RNG is used as the eager build would use it (seed it before). Raises CannotDefer.
    `patches`: the runtime's torch patches (a scope of its own without one)."""
    recorder = _Recorder()
    try:
        with (torch.device("meta"), _TensorLiterals(recorder), recorder,
              _is_meta_as_eager(patches if patches is not None else TorchPatches())):
            module = build()
    except _NeedsValues as err:
        raise CannotDefer(str(err)) from err
    if recorder.problem:
        raise CannotDefer(recorder.problem)
    if not isinstance(module, nn.Module):
        return module, InitRecord.eager()  # the caller reports what the builder returned
    record = recorder.record
    record.finals = _final_refs(module, recorder)
    replayer = _Replayer(record)
    for name, ref in record.finals.items():
        problem = replayer.problem(ref.storage, ref.version)
        if problem:
            raise CannotDefer(f"{name} {problem}")
    recorder.release()
    return module, record


def _final_refs(module: nn.Module, recorder: _Recorder) -> dict[str, Ref]:
    finals: dict[str, Ref] = {}
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if t.device.type != "meta":
            raise CannotDefer(f"the builder created {name} on {t.device}, not on the meta device")
        ref = recorder.known_ref(t)
        if ref is None:
            raise CannotDefer(f"{name} was made outside torch's dispatcher (its values were "
                              "never seen)")
        finals[name] = ref
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and value.device.type == "meta" \
                    and attr not in ("_parameters", "_buffers"):
                where = f"{mod_name}.{attr}" if mod_name else attr
                raise CannotDefer(f"the model keeps the tensor {where}, which is neither a "
                                  "parameter nor a buffer (to_empty would not move it)")
    return finals


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.record = InitRecord(deferred=True)
        self._ids: dict[int, int] = {}  # StorageImpl address -> index
        self._pins: list[torch.UntypedStorage] = []  # keep addresses from being reused
        self.problem = ""
        self._replayer = _Replayer(self.record)
        self._pool = _Pool()

    def release(self) -> None:
        self._pins.clear()
        self._ids.clear()

    # storages and references
    def _sid(self, t: torch.Tensor, register: bool = True) -> int | None:
        storage = t.untyped_storage()
        key = storage._cdata
        sid = self._ids.get(key)
        if sid is None and register:
            sid = len(self.record.storages)
            self._ids[key] = sid
            self._pins.append(storage)
            self.record.storages.append(_Storage(storage.nbytes()))
        return sid

    def known_ref(self, t: torch.Tensor) -> Ref | None:
        sid = self._sid(t, register=False)
        return None if sid is None else self._ref(t, sid)

    def _ref(self, t: torch.Tensor, sid: int) -> Ref:
        return Ref(sid, len(self.record.storages[sid].events), tuple(t.shape), tuple(t.stride()),
                   t.storage_offset(), t.dtype)

    def _input_ref(self, t: torch.Tensor) -> Ref:
        sid = self._sid(t)
        assert sid is not None
        rec = self.record.storages[sid]
        if not rec.events:  # first seen as an input: made where the dispatcher did not see it
            rec.events.append(_Event(None, poison="depends on a tensor made outside torch's "
                                                  "dispatcher (e.g. torch.frombuffer, .data "
                                                  "tricks)"))
        return self._ref(t, sid)

    def _const(self, t: torch.Tensor) -> _Const:
        self.record.constants.append(t.detach().clone())
        return _Const(len(self.record.constants) - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        metas = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        name = func._schema.name
        if metas and (func is torch.ops.aten._local_scalar_dense.default
                      or _off_meta(kwargs.get("device"))):
            return self._read(func, args, kwargs, metas)
        if torch.Tag.inplace_view in func.tags:  # metadata only (t_, squeeze_, resize_, set_)
            before = [(t, t.untyped_storage().nbytes()) for t in metas]
            out = func(*args, **kwargs)
            for t, nbytes in before:
                sid = self._sid(t, register=False)
                if sid is not None and t.untyped_storage().nbytes() != nbytes:
                    self.record.storages[sid].events.append(
                        _Event(None, poison=f"was resized in place ({name})"))
            return out
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        gens = {id(g): g.get_state() for g in leaves if isinstance(g, torch.Generator)}
        rng = torch.get_rng_state() if seeded else None
        # the inputs as the op sees them, before it runs (versions, geometry)
        refs = {id(t): self._input_ref(t) for t in metas}
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        new_metas = [(i, t) for i, t in enumerate(outs)
                     if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        if not metas and not new_metas:
            return out  # nothing of the model's (a CPU op runs for real, RNG included)
        if metas and name not in _METADATA and any(
                isinstance(v, bool | int | float | complex) for v in outs):
            return self._read(func, args, kwargs, metas)
        writes = self._written(func, args, kwargs)
        if any(t.device.type != "meta" for t in writes):
            self.problem = self.problem or f"{name} writes a CPU tensor from meta inputs"
            return out
        generators: dict[int, torch.Generator] = {}
        call = _Call(func, *self._encode(args, kwargs, refs, gens, generators), rng=rng,
                     writes=frozenset(refs[id(t)].storage for t in writes),
                     geometry_only=name.endswith("_like") or name.startswith("aten::new_"))
        depth = 1 + max((self.record.storages[r.storage].depth for r in refs.values()),
                        default=0)
        for t in writes:
            self._append_write(call, refs[id(t)], refs, name, depth)
        seen = {r.storage for r in refs.values()}
        for i, t in new_metas:
            sid = self._sid(t)
            if sid in seen:
                continue  # a view of an input, or an input returned (in-place / out=)
            seen.add(sid)
            rec = self.record.storages[sid]
            if rec.events:  # an output in a storage already known: not an op we understand
                rec.events.append(_Event(None, poison=f"was reused as the output of {name}"))
                continue
            rec.depth = depth
            rec.events.append(_Event(call, out=i, geometry=(tuple(t.shape), tuple(t.stride()),
                                                            t.storage_offset())))
            if depth > MAX_DEPTH:
                rec.events.append(_Event(None, poison=f"depends on a chain of over {MAX_DEPTH} "
                                                      "ops"))
        if seeded:
            self._advance_rng(call, generators)
        return out

    def _read(self, func, args, kwargs, metas: list[torch.Tensor]) -> Any:
        """An op that turns meta tensors into values (`.item()`, `bool()`, `.to("cpu")`, a
        rejection sampler's `mask.any()`): run for real on the inputs rebuilt from the record,
        so the builder sees the values, and branches, exactly as in the eager build."""
        if self._written(func, args, kwargs):
            raise _NeedsValues(f"{func._schema.name} reads and writes meta tensors")
        refs = {id(t): self._input_ref(t) for t in metas}
        try:
            values = {key: self._replayer.value(ref) for key, ref in refs.items()}
        except CannotDefer as err:
            raise _NeedsValues(f"the builder reads a value that {err}") from None

        def real(x):
            if isinstance(x, torch.Tensor) and id(x) in values:
                return values[id(x)]
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x
        return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _written(self, func, args, kwargs) -> list[torch.Tensor]:
        found = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
        # a tensor given twice is written once
        return list({id(t): t for t in found}.values())

    def _encode(self, args, kwargs, refs, gens, generators):
        def encode(x):
            if isinstance(x, torch.Tensor):
                return refs[id(x)] if id(x) in refs else self._const(x)
            if isinstance(x, torch.Generator):
                if x.device.type != "cpu":
                    self.problem = self.problem or f"an op draws from a {x.device} generator"
                encoded = _Gen(gens[id(x)])
                generators[id(encoded)] = x
                return encoded
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x
        return tree_map(encode, args), tree_map(encode, kwargs)

    def _append_write(self, call: _Call, target: Ref, refs: dict, name: str, depth: int) -> None:
        rec = self.record.storages[target.storage]
        rec.depth = max(rec.depth, depth)
        others_read = any(r.storage == target.storage and r is not target for r in refs.values())
        full = (name in _OVERWRITES and len(call.writes) == 1 and not others_read
                and target.offset == 0 and _dense_prefix(target)
                and _numel(target.size) * target.dtype.itemsize == rec.nbytes)
        if full:
            rec.restarts.append(len(rec.events))
        rec.events.append(_Event(call))
        if rec.depth > MAX_DEPTH:
            rec.events.append(_Event(None, poison=f"depends on a chain of over {MAX_DEPTH} ops"))

    def _advance_rng(self, call: _Call, generators: dict[int, torch.Generator]) -> None:
        """Run a random op for real on CPU scratch tensors, so that the generators advance as in
        the eager build (the meta kernel draws nothing): the tensors it writes are scratch of
        the same geometry, the ones it reads are rebuilt; explicit generators are the builder's
        own objects, so that they advance too."""
        def scratch(x):
            if isinstance(x, Ref):
                if x.storage in call.writes or call.geometry_only:
                    buffer = self._pool.take(_extent(x))  # the first one; others are fresh
                    return _scratch(x) if buffer is None else _view(buffer, x)
                return self._replayer.value(x)
            if isinstance(x, _Const):
                return self.record.constants[x.index]
            if isinstance(x, _Gen):
                return generators[id(x)]
            return x
        try:
            args, kwargs = tree_map(scratch, call.args), tree_map(scratch, call.kwargs)
            call.func(*args, **kwargs)
        except CannotDefer as err:
            self.problem = self.problem or f"{call.func._schema.name}: {err}"
        finally:
            self._pool.release()


class _TensorLiterals(torch.overrides.TorchFunctionMode):
    """`torch.tensor([...])` and friends under the meta device make a meta tensor without any op
    the dispatcher sees; made on the CPU and copied to meta, their values are recorded."""

    FUNCS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.FUNCS and _on_meta(kwargs.get("device")):
            kwargs["device"] = "cpu"
            requires_grad = kwargs.pop("requires_grad", False)
            out = func(*args, **kwargs).to("meta")
            return out.requires_grad_(requires_grad) if requires_grad else out
        if func is torch.Tensor.new_tensor and args and args[0].device.type == "meta" \
                and _on_meta(kwargs.get("device", "meta")):
            kwargs["device"] = "cpu"
            kwargs.setdefault("dtype", args[0].dtype)
            requires_grad = kwargs.pop("requires_grad", False)
            out = torch.tensor(args[1], **kwargs).to("meta")
            return out.requires_grad_(requires_grad) if requires_grad else out
        return func(*args, **kwargs)


def _off_meta(device: Any) -> bool:
    """A device argument other than meta (an op that moves a meta tensor off meta)."""
    return device is not None and torch.device(device).type != "meta"


def _on_meta(device: Any) -> bool:
    if device is None:
        return torch.get_default_device().type == "meta"
    return torch.device(device).type == "meta"


@contextlib.contextmanager
def _is_meta_as_eager(patches: TorchPatches) -> Iterator[None]:
    """`Tensor.is_meta` is False for `torch.nn.init` and for code outside torch while recording,
    as in the eager build: `trunc_normal_`, `orthogonal_`, `dirac_` and `sparse_` return early
    on meta tensors, skipping their random draws (torch's own internals see the truth). Set
    through `patches` and put back when the build ends."""
    real = TensorBase.is_meta

    def is_meta(self: torch.Tensor) -> bool:
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(_TORCH_DIR) and caller != _INIT_FILE:
            return real.__get__(self)
        return False

    with patches.scope():
        patches.set(torch.Tensor, "is_meta", property(is_meta))
        yield

