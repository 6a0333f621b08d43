"""Replay a recorded meta-device build on the CPU: any storage of the record, at any version.

**Replay.** A storage at a version is rebuilt on the CPU from its events: the creation op (meta
device replaced by cpu), then the in-place ops on views of the buffer, tensor arguments from
other storages rebuilt (recursively) at the version the op saw, random ops run from their saved
generator state. A write that overwrites the whole storage without reading it (`normal_`,
`fill_`, `copy_`, ...) makes the events before it dead, so replay starts there. Intermediates
(tensors no parameter or buffer is) are cached up to a byte budget; parameters are rebuilt when
asked for, in one reused buffer. Peak memory: the largest tensor plus its dependencies.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from shardwise.compat import tree_flatten, tree_leaves, tree_map
from shardwise.models.deferred.buffers import _Pool, _scratch, _view
from shardwise.models.deferred.record import (
    CannotDefer,
    InitRecord,
    Ref,
    _Call,
    _Const,
    _Event,
    _Gen,
    _Storage,
)

CACHE_BYTES = 64 << 20  # intermediates kept between replays (rotary tables, QR factors, ...)


class _Replayer:
    """Rebuilds storages of a record on the CPU."""

    def __init__(self, record: InitRecord, budget: int = CACHE_BYTES) -> None:
        self.record = record
        self.budget = budget
        self._cache: OrderedDict[tuple[int, int], torch.UntypedStorage] = OrderedDict()
        self._cached_bytes = 0
        self._finals = {r.storage for r in record.finals.values()}

    def value(self, ref: Ref) -> torch.Tensor:
        """The tensor `ref` names, rebuilt (treat as read-only: it may be cached)."""
        return _view(self.storage_at(ref.storage, ref.version), ref)

    @contextlib.contextmanager
    def final(self, ref: Ref, pool: _Pool) -> Iterator[torch.Tensor]:
        """`value(ref)`, rebuilt in `pool`'s buffer when it starts from a whole overwrite (valid
        inside the `with` only)."""
        try:
            yield _view(self.storage_at(ref.storage, ref.version, pool), ref)
        finally:
            pool.release()

    def problem(self, sid: int, version: int, _seen: set | None = None) -> str:
        """Why storage `sid` at `version` cannot be rebuilt ("" if it can)."""
        seen = _seen if _seen is not None else set()
        if (sid, version) in seen:
            return ""
        seen.add((sid, version))
        rec = self.record.storages[sid]
        for k in range(self._start(rec, version), version):
            event = rec.events[k]
            if event.poison:
                return event.poison
            for ref in _refs(event.call):
                if ref.storage != sid:
                    found = self.problem(ref.storage, ref.version, seen)
                    if found:
                        return found
        return ""

    @staticmethod
    def _start(rec: _Storage, version: int) -> int:
        starts = [k for k in rec.restarts if k < version]
        return starts[-1] if starts else 0

    def storage_at(self, sid: int, version: int,
                   pool: _Pool | None = None) -> torch.UntypedStorage:
        key = (sid, version)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        rec = self.record.storages[sid]
        start = self._start(rec, version)
        if version == 0:
            raise CannotDefer("a tensor is read before anything wrote it")
        storage = None
        if start > 0:
            storage = pool.take(rec.nbytes) if pool is not None else None
            if storage is None:
                storage = torch.UntypedStorage(rec.nbytes, device="cpu")
            else:
                key = None  # pooled: never cached
        for k in range(start, version):
            event = rec.events[k]
            if event.poison:
                raise CannotDefer(event.poison)
            assert event.call is not None
            if event.out >= 0:
                storage = self._create(event, rec, sid)
            else:
                assert storage is not None
                self._run(event.call, live=(sid, storage))
        assert storage is not None
        if key is not None:
            self._remember(key, storage)
        return storage

    def _create(self, event: _Event, rec: _Storage, sid: int) -> torch.UntypedStorage:
        assert event.call is not None and event.geometry is not None
        outs, _ = tree_flatten(self._run(event.call))
        out = outs[event.out]
        size, stride, offset = event.geometry
        same = (tuple(out.shape) == size and tuple(out.stride()) == stride
                and out.storage_offset() == offset and out.untyped_storage().nbytes() == rec.nbytes)
        if same:
            storage = out.untyped_storage()
        else:  # the CPU kernel laid it out otherwise than the meta kernel: copy it as recorded
            storage = torch.UntypedStorage(rec.nbytes, device="cpu")
            _view(storage, Ref(sid, 0, size, stride, offset, out.dtype)).copy_(out)
        return storage

    def _run(self, call: _Call, live: tuple[int, torch.UntypedStorage] | None = None) -> Any:
        memo: dict[tuple[int, int], torch.UntypedStorage] = {}

        def materialise(x):
            if isinstance(x, Ref):
                if live is not None and x.storage == live[0]:
                    return _view(live[1], x)
                if call.geometry_only:
                    return _scratch(x)
                key = (x.storage, x.version)
                if key not in memo:
                    memo[key] = self.storage_at(*key)
                    if x.storage in call.writes:  # another storage this op mutates: a copy
                        copy = torch.UntypedStorage(memo[key].nbytes(), device="cpu")
                        copy.copy_(memo[key])
                        memo[key] = copy
                return _view(memo[key], x)
            if isinstance(x, _Const):
                return self.record.constants[x.index]
            if isinstance(x, _Gen):
                g = torch.Generator(device="cpu")
                g.set_state(x.state)
                return g
            return x

        args, kwargs = tree_map(materialise, call.args), tree_map(materialise, call.kwargs)
        if call.rng is None:
            return call.func(*args, **kwargs)
        saved = torch.get_rng_state()
        torch.set_rng_state(call.rng)
        try:
            return call.func(*args, **kwargs)
        finally:
            torch.set_rng_state(saved)

    def _remember(self, key: tuple[int, int], storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        if key[0] in self._finals or nbytes > self.budget // 4:
            return
        self._cache[key] = storage
        self._cached_bytes += nbytes
        while self._cached_bytes > self.budget:
            _, dropped = self._cache.popitem(last=False)
            self._cached_bytes -= dropped.nbytes()


def _refs(call: _Call | None) -> list[Ref]:
    if call is None:
        return []
    return [x for x in tree_leaves((call.args, call.kwargs)) if isinstance(x, Ref)]

