"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout: RUN_DIR/checkpoints/step-000123/ holds the DCP shards (`*.distcp` + `.metadata`), one
`rng/rank-NNNNN.pt` per rank, and `meta.json`, written last. Everything is first written under
`step-000123.staging/` and renamed only when complete, so a directory named `step-*` without a
suffix and with a `meta.json` is a complete checkpoint; anything else is ignored by the loader.

The checkpointer knows nothing of the insides of what it saves: it receives a dict of Stateful
objects (model+optimizer, train state, data cursor) and calls their state_dict/load_state_dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.checkpoint.integrity import META, Verdict, hash_files, sizes_match, verify
from shardwise.errors import UserError
from shardwise.utils.files import atomic_write_text

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


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
    options = StateDictOptions(full_state_dict=True)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update({k: v.detach().cpu() for k, v in get_model_state_dict(part, options=options)
                       .items()})
    if pp_group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(gathered, merged, group=pp_group)
        for other in gathered:
            merged.update(other)
    return merged


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


class Checkpointer:
    def __init__(self, root: Path, rank: int, distributed: bool, keep_last: int = 0,
                 keep_every: int = 0) -> None:
        self.root = root
        self.rank = rank
        self.distributed = distributed
        self.world = dist.get_world_size() if distributed else 1
        self.keep_last, self.keep_every = keep_last, keep_every

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def save(self, step: int, components: dict[str, Any], meta: dict[str, Any],
             attach: tuple[Path, ...] = (), on_written: Callable[[], None] | None = None) -> Path:
        """Write a complete checkpoint for `step` (collective: every rank calls it). Files in
        `attach` (the run manifest) are copied in by rank 0 before the checkpoint is committed."""
        final = self.root / step_dir_name(step)
        staging = self.root / f"{step_dir_name(step)}.staging"
        t0 = time.perf_counter()
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self._barrier()
        state = {name: _wrap(obj) for name, obj in components.items()}
        with _quiet_single_process(self.distributed):
            dcp.save(state, checkpoint_id=str(staging), no_dist=not self.distributed)
        (staging / "rng").mkdir(exist_ok=True)
        _save_synced(rng_state(), staging / "rng" / f"rank-{self.rank:05d}.pt")
        if on_written is not None:  # shards written, nothing committed yet (fault drills)
            on_written()
        if self.rank == 0:
            for path in attach:
                shutil.copy2(path, staging / path.name)
        self._barrier()
        files = hash_files(staging, self.rank, self.world, self.distributed)
        if self.rank == 0:
            meta = {**meta, "step": step, "save_seconds": round(time.perf_counter() - t0, 4),
                    "files": files}
            # meta.json last: a directory without it is never loaded
            atomic_write_text(staging / META, json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # the same step saved again (e.g. stop_at == a cadence step)
                shutil.rmtree(final)
            os.replace(staging, final)
            _fsync_dir(self.root)
            self._prune(step)
        self._barrier()
        return final

    def _prune(self, newest: int) -> None:
        """Retention: keep the last `keep_last` checkpoints and every `keep_every`-th step."""
        if self.keep_last <= 0:
            return
        steps = sorted(int(p.name.split("-")[1]) for p in self.root.iterdir()
                       if _STEP_DIR.match(p.name))
        keep = set(steps[-self.keep_last:]) | {newest}
        for step in steps:
            if step not in keep and not (self.keep_every and step % self.keep_every == 0):
                shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def candidates(self) -> list[Path]:
        """Checkpoint directories named step-NNNNNN, newest first (complete or not)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]), reverse=True)

    def find_valid(self) -> tuple[Path | None, list[Verdict]]:
        """The newest checkpoint whose every file matches its recorded size and SHA-256, and the
        verdicts of the newer ones that did not (collective: ranks hash in parallel)."""
        rejected: list[Verdict] = []
        for path in self.candidates():
            verdict = verify(path, self.rank, self.world, self.distributed)
            if verdict.valid:
                return path, rejected
            rejected.append(verdict)
        return None, rejected

    def latest(self) -> Path | None:
        """Newest checkpoint whose meta.json lists files of the right sizes (no hashing)."""
        return next((p for p in self.candidates() if sizes_match(p)), None)

    def load(self, path: Path, components: dict[str, Any]) -> dict[str, Any]:
        """Restore every component from `path` in place; return its meta."""
        meta_path = path / META
        if not meta_path.is_file():
            raise UserError(f"{path} is not a complete checkpoint (no {META}); it may be a "
                            "save that was interrupted. Resume from an earlier checkpoint.")
        state = {name: _wrap(obj) for name, obj in components.items()}
        with _quiet_single_process(self.distributed):
            dcp.load(state, checkpoint_id=str(path), no_dist=not self.distributed)
        rng_file = path / "rng" / f"rank-{self.rank:05d}.pt"
        if rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=True))
        return json.loads(meta_path.read_text())


def _save_synced(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it 'assumes' single-process mode; for us that is the intended mode."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _wrap(obj: Any) -> Stateful:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
