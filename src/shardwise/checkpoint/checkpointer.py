"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Layout (`shardwise.checkpoint.layout`): ROOT/step-000123/ holds the DCP shards (`*.distcp` + `.metadata`), one
`rng/rank-NNNNN.pt` per rank, the run manifest, and `meta.json` (per-file sizes and SHA-256),
written last. ROOT is RUN_DIR/checkpoints or `checkpoint.uri` (a local directory or an S3 prefix);
how a save is committed there — rename of a `.staging` directory on disk, meta.json last on object
storage — is the storage layer's business (`shardwise.checkpoint.storage`). A `step-*` directory
is loaded only if its meta.json exists and every file matches it.

Async save (`checkpoint.async_save`): the step loop waits only while the state is copied to host
memory, into buffers that the checkpointer's `HostStager` keeps and reuses from save to save (pinned
when CUDA is available; DTensors staged with CPU local shards, see `shardwise.checkpoint.staging`);
`dcp.async_save` then writes the shards from a background thread on a process group of its own
(gloo), so its collectives never interleave with training collectives, and a second thread of ours
finishes the job in the same order as a synchronous save — rng files, hashes, meta.json, commit,
retention. One save is in flight at a time: the next save, every read of the checkpoints
(find_valid, latest, load) and `wait()` at the end of the run first wait for it. A crash during the
background write leaves an uncommitted save that is never loaded, exactly as a crash during a
synchronous one.

The checkpointer knows nothing of the insides of what it saves: it receives a dict of Stateful
objects (model+optimizer, train state, data cursor; `shardwise.checkpoint.state` adapts them) and
calls their state_dict/load_state_dict.

(About 400 lines for one job, a save's life from the claim on the location to retention, and
the reads that must wait for a save in flight: those share the one-save-at-a-time state.)
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardwise.checkpoint import chain, discovery, ownership, registry, volume
from shardwise.checkpoint.integrity import Verdict, hash_files, sizes_match
from shardwise.checkpoint.layout import META, rng_file, step_dir_name, step_of
from shardwise.checkpoint.location import Location, StorageSpec
from shardwise.checkpoint.staging import HostStager
from shardwise.checkpoint.state import rng_state, set_rng_state, wrap
from shardwise.checkpoint.storage import (
    Storage,
    follow_location,
    open_storage,
    read_torch,
    record_location,
    torch_bytes,
)
from shardwise.compat import side_group
from shardwise.errors import UserError
from shardwise.telemetry.memory import peak_during


@dataclass
class SaveRecord:
    """What one save cost, for the `checkpoint` event. `stall_s` is the time the step loop was
    blocked (waiting for the previous save, staging, and for a synchronous save the whole save);
    `write_s` the background part, from the end of staging to the commit (0 when synchronous), so
    that stall + write is the save's whole time either way. `device_peak_bytes` (CUDA; None
    elsewhere) is the peak allocated device memory while the step loop was in the save: the
    staging of an async save, the whole of a synchronous one; `host_staging_bytes` the host
    buffers an async save copies into (0 for a synchronous save, which writes from the live
    tensors)."""

    step: int
    path: Location
    mode: str  # "sync" or "async"
    stall_s: float
    waited_s: float  # part of stall_s spent waiting for the previous save to finish
    write_s: float = 0.0
    bytes: int = 0
    save_seconds: float = 0.0  # from the save call to the commit
    device_peak_bytes: int | None = None
    host_staging_bytes: int = 0

    def event_fields(self) -> dict[str, Any]:
        return {"path": str(self.path), "mode": self.mode, "stall_s": round(self.stall_s, 4),
                "waited_s": round(self.waited_s, 4), "write_s": round(self.write_s, 4),
                "bytes": self.bytes, "save_seconds": round(self.save_seconds, 4),
                "device_peak_bytes": self.device_peak_bytes,
                "host_staging_bytes": self.host_staging_bytes}


@dataclass
class _Pending:
    record: SaveRecord
    on_committed: Callable[[SaveRecord], None] | None
    thread: threading.Thread | None = None
    error: BaseException | None = None


class Checkpointer:
    def __init__(self, root: Path, rank: int, distributed: bool, keep_last: int = 0,
                 keep_every: int = 0, *, storage: Storage[Any] | None = None,
                 async_save: bool = False,
                 timeout_s: float = 300.0, device: torch.device | None = None) -> None:
        """`root` is RUN_DIR/checkpoints; without `storage`, the checkpoints are wherever that
        directory's location.json says (see `for_run`), else in it. `device` is where the
        saved tensors live (their peak memory is measured on CUDA)."""
        self.storage = storage if storage is not None else follow_location(root)
        self.root: Location = self.storage.root
        self.rank = rank
        self.distributed = distributed
        self.world = dist.get_world_size() if distributed else 1
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.device = device
        # The host buffers of every async save, kept (and reused) as long as the checkpointer.
        self.stager = HostStager(pin=None if device is None else device.type == "cuda")
        self._pending: _Pending | None = None
        self.run_id: str | None = None  # set by `claim`: the run whose location this is
        self._run_dir = Path(".")
        self._owner_written = False
        self._lock: ownership.FileLock | ownership.LeaseLock | None = None
        self._head: chain.Head | None = None  # what the next save descends from (rank 0)
        # A gloo group of its own (collective to create: every rank builds its Checkpointer at the
        # same point): background save collectives never interleave with training ones.
        self.group: dist.ProcessGroup | None = None
        if distributed and async_save:
            self.group = side_group("checkpoint", timeout_s)

    @classmethod
    def for_run(cls, local_root: Path, section: Any, rank: int, distributed: bool,
                timeout_s: float = 300.0, device: torch.device | None = None) -> Checkpointer:
        """The checkpointer a run's CheckpointSection describes. Rank 0 records a location other
        than `local_root` in local_root/location.json, so that code knowing only the run
        directory (restart detection, `train --resume`) finds the checkpoints."""
        spec = StorageSpec.from_section(section)
        storage = open_storage(spec, local_root)
        if rank == 0:
            local_root.mkdir(parents=True, exist_ok=True)
            record_location(spec, storage, local_root)
        return cls(local_root, rank, distributed, section.keep_last, section.keep_every,
                   storage=storage, async_save=section.async_save, timeout_s=timeout_s,
                   device=device)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    # --- whose location, which launch ------------------------------------------------------------
    def claim(self, run_id: str, run_dir: Path, fresh: bool, wait_s: float) -> None:
        """Make the location this run's for this launch (collective; see `checkpoint.ownership`):
        refuse one another run owns (or, for a fresh run, one holding checkpoints nobody owns),
        take the launch lock (waiting up to `wait_s` for a draining launch of the same run),
        then remove saves a crash interrupted: under the lock, nobody else is writing them."""
        self.run_id, self._run_dir = run_id, run_dir
        problem: list[Any] = [None]
        if self.rank == 0:
            try:
                ownership.check_owner(self.root, self.storage.step_dirs(), run_id, run_dir, fresh)
                self._lock = ownership.lock_for(self.root)
                ownership.acquire(self._lock, ownership.launch_id(), run_id, wait_s, self.root)
                self._owner_written = ownership.read_owner(self.root) is not None
                self.storage.recover()
                for stale in discovery.uncommitted(self.storage):
                    print(f"note: removing {stale}, a save that was interrupted before its "
                          "commit (never loaded)", file=sys.stderr)
                    self.storage.remove(stale)
            except UserError as err:
                problem[0] = str(err)
        if self.distributed:
            dist.broadcast_object_list(problem, src=0, group=self.group)
        if problem[0] is not None:
            raise UserError(str(problem[0]))

    def _check_room(self, step: int) -> None:
        """Refuse a save that cannot fit (collective: rank 0 looks, every rank hears): the free
        space of a local volume against the size of the newest checkpoint there."""
        problem: list[Any] = [None]
        if self.rank == 0:
            newest = volume.newest_committed(self.storage.step_dirs())
            needed = int(volume.checkpoint_bytes(newest) * volume.MARGIN) if newest else 0
            free = volume.free_bytes(self.root)
            if needed and free is not None and free < needed and newest is not None \
                    and step_of(newest) != step:  # (a re-save of one step replaces it)
                problem[0] = volume.full_message(self.root, step, needed, newest.name, free)
        if self.distributed:
            dist.broadcast_object_list(problem, src=0, group=self.group)
        if problem[0] is not None:
            raise UserError(str(problem[0]))

    def _raise_if_full(self, err: BaseException, step: int, staging: Location) -> None:
        """Re-word a write that ran out of room (see `checkpoint.volume`), giving the space of
        the interrupted save back; any other error is left to the caller."""
        if not volume.is_out_of_space(err):
            return
        newest = volume.newest_committed(self.storage.step_dirs())
        needed = volume.checkpoint_bytes(newest) if newest is not None else 0
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self.storage.remove(staging)
        raise UserError(volume.full_message(self.root, step, needed,
                                            newest.name if newest else None)) from None

    def release(self) -> None:
        """Let go of the launch lock (after the last commit)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- save ----------------------------------------------------------------------------------
    def save(self, step: int, components: dict[str, Any], meta: dict[str, Any],
             attach: tuple[Path, ...] = (), on_written: Callable[[], None] | None = None,
             on_committed: Callable[[SaveRecord], None] | None = None) -> Location:
        """Write a complete checkpoint for `step` (collective: every rank calls it) and return
        the path it has (async: will have) once committed. Files in `attach` (the run manifest)
        are copied in by rank 0. `on_written` runs once this rank's files are written and
        nothing is committed (fault drills); `on_committed(record)` runs in the calling thread
        after the commit — at once for a synchronous save, at the next save or `wait()` for an
        asynchronous one."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        final = self.root / step_dir_name(step)
        staging = self.storage.staging(final)
        self._check_room(step)
        if self.rank == 0:
            self.storage.prepare(staging, final)
        self._barrier()
        state = {name: wrap(obj) for name, obj in components.items()}
        extra = {rng_file(self.rank): torch_bytes(rng_state())}
        if self.rank == 0:
            extra.update({path.name: path.read_bytes() for path in attach})
        record = SaveRecord(step, final, "async" if self.async_save else "sync", 0.0, waited)
        pending = _Pending(record, on_committed)
        if not self.async_save:
            t_write = time.perf_counter()
            try:
                with _quiet_single_process(self.distributed), peak_during(self.device) as peak:
                    dcp.save(state, storage_writer=self.storage.writer(staging),
                             no_dist=not self.distributed)
                record.device_peak_bytes = peak.bytes
                self._finish(pending, None, staging, final, meta, extra, on_written, t0, t_write)
            except BaseException as err:  # (DCP's CheckpointException is a BaseException)
                self._raise_if_full(err, step, staging)
                raise
            record.stall_s = time.perf_counter() - t0
            self._pending = pending
            self.wait()
            return final
        with peak_during(self.device) as peak:  # staging happens inside async_save
            future = dcp.async_save(state, storage_writer=self.storage.writer(staging, self.stager),
                                    process_group=self.group,
                                    **_single_process_kwargs(self.distributed))
        t_write = time.perf_counter()
        record.stall_s = t_write - t0
        record.device_peak_bytes, record.host_staging_bytes = peak.bytes, self.stager.nbytes
        pending.thread = threading.Thread(
            target=self._finish, name=f"checkpoint-step-{step}", daemon=True,
            args=(pending, future, staging, final, meta, extra, on_written, t0, t_write))
        self._pending = pending
        pending.thread.start()
        return final

    def _finish(self, pending: _Pending, future: Any, staging: Location, final: Location,
                meta: dict[str, Any], extra: dict[str, bytes], on_written: Callable[[], None] | None,
                t0: float, t_write: float) -> None:
        """After the shards: this rank's small files, then hashes of every file (ranks in
        parallel), meta.json last and the commit (rank 0), retention. The background thread of
        an async save; inline for a synchronous one. Errors are kept for `wait()`."""
        try:
            if future is not None:
                future.result()
            for name, data in extra.items():
                self.storage.write_file(staging / name, data)
            if on_written is not None:  # shards written, nothing committed yet (fault drills)
                on_written()
            self._barrier()
            files = hash_files(staging, self.rank, self.world, self.distributed, self.group)
            record = pending.record
            if self.rank == 0:
                meta = {**meta, "step": record.step,
                        "save_seconds": round(time.perf_counter() - t0, 4), "files": files,
                        chain.KEY: chain.next_link(self._head, record.step)}
                if self.run_id is not None:
                    meta["run_id"] = self.run_id
                    if not self._owner_written:  # the first save makes the location this run's
                        ownership.write_owner(self.root, self.run_id, self._run_dir)
                        self._owner_written = True
                meta_text = json.dumps(meta, indent=2, sort_keys=True)
                self.storage.commit(staging, final, meta_text)
                self._head = chain.Head.of(meta_text)
                self._prune(record.step)
            self._barrier()
            record.bytes = sum(int(f["size"]) for f in files.values())
            record.write_s = time.perf_counter() - t_write if future is not None else 0.0
            record.save_seconds = time.perf_counter() - t0
        except BaseException as err:  # handed to wait(), which re-raises it
            if future is None:
                raise
            pending.error = err

    def wait(self) -> SaveRecord | None:
        """Finish the save in flight, if any: wait for its commit, run its `on_committed`, and
        re-raise what went wrong in the background. Call before the process exits."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.thread is not None:
            pending.thread.join()
        if pending.error is not None:
            self._raise_if_full(pending.error, pending.record.step,
                                self.storage.staging(pending.record.path))
            error = pending.error
            error.add_note(f"(while saving checkpoint {pending.record.path} in the background; "
                           "it was not committed and will never be loaded)")
            raise error
        if pending.on_committed is not None:
            pending.on_committed(pending.record)
        return pending.record

    def close(self, pause: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
              ) -> None:
        """`wait()` at the end of a run, normal or not, inside `pause()` (the hang watchdog steps
        aside: a write may legitimately take long). On the way out of an exception the save in
        flight still gets to commit — its data is good, it was staged before the failure — and a
        failure of its own does not mask the exception already propagating. Call it while the
        run's comm tap is still installed: the background save's collectives go through it."""
        failing = sys.exc_info()[1] is not None
        try:
            with pause() if pause is not None and self.in_flight else contextlib.nullcontext():
                self.wait()
        except Exception:
            if not failing:
                raise
        finally:
            self.release()

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _prune(self, newest: int) -> None:
        """Retention: keep the last `keep_last` committed checkpoints, every `keep_every`-th step
        and every registered one (`checkpoint.registry`). Only committed ones count and go (an
        uncommitted save is not a checkpoint: counting it would push a valid one out); the
        location is this run's (`claim`)."""
        if self.keep_last <= 0:
            return
        steps = sorted(step for p in ownership.committed(self.storage.step_dirs())
                       if (step := step_of(p)) is not None)
        keep = set(steps[-self.keep_last:]) | {newest} | registry.protected_steps(self.root)
        for step in steps:
            if step not in keep and not (self.keep_every and step % self.keep_every == 0):
                self.storage.remove(self.root / step_dir_name(step))

    # --- find and load -------------------------------------------------------------------------
    def candidates(self) -> list[Location]:
        """Checkpoint directories named step-NNNNNN, newest first (complete or not)."""
        self.wait()
        return discovery.candidates(self.storage)

    def find_valid(self) -> tuple[Location | None, list[Verdict]]:
        """The newest checkpoint whose every file matches its recorded size and SHA-256, and the
        verdicts of the newer ones that did not (collective: ranks hash in parallel)."""
        self.wait()
        if self.rank == 0:
            self.storage.recover()
        self._barrier()  # every rank lists the same directories, recovered ones included
        return discovery.newest_valid(self.storage, self.rank, self.world, self.distributed,
                                      self.group)

    def latest(self) -> Location | None:
        """Newest checkpoint whose meta.json lists files of the right sizes (no hashing; not
        collective, so only rank 0 puts back an interrupted re-save first)."""
        self.wait()
        if self.rank != 0:
            return next((p for p in self.candidates() if sizes_match(p)), None)
        return discovery.newest_complete(self.storage)

    def load(self, path: Location, components: dict[str, Any]) -> dict[str, Any]:
        """Restore every component from `path` in place; return its meta."""
        self.wait()
        try:
            meta_text = (path / META).read_text()
        except FileNotFoundError:
            raise UserError(f"{path} is not a complete checkpoint (no {META}); it may be a "
                            "save that was interrupted. Resume from an earlier checkpoint.") from None
        self._head = chain.Head.of(meta_text)  # the next save descends from this checkpoint
        state = {name: wrap(obj) for name, obj in components.items()}
        with _quiet_single_process(self.distributed):
            dcp.load(state, storage_reader=self.storage.reader(path),
                     process_group=self.group, no_dist=not self.distributed)
        # a rank that did not exist at the saving world size keeps its seeded state
        with contextlib.suppress(FileNotFoundError):
            set_rng_state(read_torch(path / rng_file(self.rank)))
        return json.loads(meta_text)


def _single_process_kwargs(distributed: bool) -> dict[str, Any]:
    """`no_dist=True` for a process without a group, on torch versions whose async_save has it
    (older ones infer it). DCP then warns from its background thread, where a `catch_warnings`
    block cannot reach (it is not thread-safe), so that one message is filtered process-wide."""
    if distributed:
        return {}
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                            "uninitialized, assuming the intent is to save in a single process")
    return {"no_dist": True} if "no_dist" in inspect.signature(dcp.async_save).parameters else {}


@contextlib.contextmanager
def _quiet_single_process(distributed: bool) -> Iterator[None]:
    """DCP warns that it 'assumes' single-process mode; for us that is the intended mode."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
