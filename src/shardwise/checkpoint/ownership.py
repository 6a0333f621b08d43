"""Which run a checkpoint location belongs to, and which launch may write to it now.

A location (RUN_DIR/checkpoints, or `checkpoint.uri`) belongs to one run. The run's id is made
with its run directory (`RUN_DIR/run-id`, see `run.rundir.run_id`); the first save writes it into
ROOT/owner.json. Then:

- a fresh run refuses a location that another run owns, or that holds committed checkpoints and no
  owner (copied there by hand, or written before owners were recorded): its saves would replace
  that run's steps, and its retention would prune them;
- a resume refuses a location that another run owns; one with no owner is this run's own
  (RUN_DIR/checkpoints of an older run directory) and is adopted by the next save;
- only committed checkpoints whose meta.json names this run (or none: older ones) are this run's.

A launch holds the location's lock from the moment its checkpointer claims the location until its
last save is committed, so two launches of one run (a requeue while the old job drains, the same
TOML started twice) never save into one location at once. On disk it is an exclusive `flock` on
ROOT/.lock, which the kernel releases when the holder dies, however it dies (on network filesystems
flock is only as good as the filesystem's locking: NFSv4 and Lustre honour it). Object storage has
no locks: there it is a lease, ROOT/lock.json, renewed by a thread of the holder every
`LEASE_S / 4` seconds; a lease not renewed for `LEASE_S` belongs to a launch that died and may be
taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import LEASE, LOCK, META, OWNER, step_of
from shardwise.checkpoint.location import Location
from shardwise.errors import UserError

LEASE_S = 120.0  # a lease not renewed for this long is a dead launch's


@dataclass(frozen=True)
class Owner:
    """What ROOT/owner.json says."""

    run_id: str
    run_dir: str
    since: float


def read_owner(root: Location) -> Owner | None:
    try:
        data = json.loads((root / OWNER).read_text())
        return Owner(str(data["run_id"]), str(data.get("run_dir", "")), float(data.get("since", 0)))
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def write_owner(root: Location, run_id: str, run_dir: Path) -> None:
    text = json.dumps(asdict(Owner(run_id, str(run_dir.resolve()), time.time())), indent=2)
    if isinstance(root, Path):
        from shardwise.utils.files import atomic_write_text

        atomic_write_text(root / OWNER, text + "\n")
    else:
        (root / OWNER).write_text(text + "\n")


def committed(step_dirs: list[Location]) -> list[Location]:
    """The step directories that hold a commit (meta.json), any run's."""
    return [p for p in step_dirs if step_of(p) is not None and (p / META).exists()]


def check_owner(root: Location, step_dirs: list[Location], run_id: str, run_dir: Path,
                fresh: bool) -> None:
    """Refuse a location this run may not write to (see the module docstring), with what to do."""
    owner = read_owner(root)
    if owner is not None and owner.run_id != run_id:
        where = f" (run directory {owner.run_dir})" if owner.run_dir else ""
        raise UserError(
            f"the checkpoint location {root} belongs to another run{where}, id {owner.run_id}. "
            "Saving there would replace that run's steps and prune them. Give this run a "
            "location of its own (checkpoint.uri: a new prefix, or empty for RUN_DIR/checkpoints),"
            f" or continue that run with `shardwise train --resume "
            f"{owner.run_dir or 'ITS_RUN_DIR'}`.")
    if owner is None and fresh:
        found = committed(step_dirs)
        if found:
            steps = sorted(s for p in found if (s := step_of(p)) is not None)
            raise UserError(
                f"the checkpoint location {root} already holds committed checkpoints (steps "
                f"{', '.join(map(str, steps[-3:]))}) that no run claims as its own, and this is a "
                "fresh run: its saves would replace them and its retention would prune them. Use "
                "an empty location for a new run (checkpoint.uri: a new prefix), or move those "
                "checkpoints away first.")


def belongs(meta: dict[str, Any], run_id: str) -> bool:
    """A committed checkpoint's meta.json is this run's (older ones name no run)."""
    return meta.get("run_id") in (None, run_id)


# --- the lock of a launch -------------------------------------------------------------------------
def holder_text(launch: str, run_id: str) -> str:
    return json.dumps({"launch": launch, "run_id": run_id, "host": socket.gethostname(),
                       "pid": os.getpid(), "since": time.time()})


def describe_holder(text: str) -> str:
    try:
        h = json.loads(text)
        return (f"launch {h['launch']} (pid {h['pid']} on {h['host']}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h['since']))})")
    except (ValueError, KeyError, TypeError):
        return "another launch"


class FileLock:
    """An exclusive flock on ROOT/.lock, for the life of this process's launch."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK
        self.fd: int | None = None

    def try_acquire(self, launch: str, run_id: str) -> str | None:
        """None once held; else who holds it."""
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                held = os.pread(fd, 4096, 0).decode(errors="replace")
            except OSError:
                held = ""
            os.close(fd)
            return describe_holder(held)
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_text(launch, run_id).encode(), 0)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


class LeaseLock:
    """ROOT/lock.json on object storage: held while renewed (see the module docstring)."""

    def __init__(self, root: Location, lease_s: float = LEASE_S) -> None:
        self.path = root / LEASE
        self.lease_s = lease_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._text = ""

    def try_acquire(self, launch: str, run_id: str) -> str | None:
        try:
            current = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            current = None
        # judged by the holder's own lease length, which it wrote
        if current is not None and current.get("launch") != launch \
                and time.time() - float(current.get("renewed", 0)) \
                < float(current.get("lease_s", self.lease_s)):
            return describe_holder(json.dumps(current))
        self._text = holder_text(launch, run_id)
        self._renew()
        self._thread = threading.Thread(target=self._keep, name="checkpoint-lease", daemon=True)
        self._thread.start()
        return None

    def _renew(self) -> None:
        self.path.write_text(json.dumps({**json.loads(self._text), "renewed": time.time(),
                                         "lease_s": self.lease_s}))

    def _keep(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with contextlib.suppress(Exception):  # a missed renewal is retried; LEASE_S is long
                self._renew()

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        with contextlib.suppress(Exception):
            self.path.unlink(missing_ok=True)


def holder(root: Location) -> str | None:
    """Who holds the location's lock now (a running launch), read without taking it or writing
    anything (`gc --dry-run`); None when nobody does."""
    if isinstance(root, Path):
        import fcntl

        try:
            fd = os.open(root / LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # conflicts with a launch's LOCK_EX
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except OSError:
            return describe_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        finally:
            os.close(fd)
    try:
        current = json.loads((root / LEASE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    fresh = time.time() - float(current.get("renewed", 0)) < float(current.get("lease_s", LEASE_S))
    return describe_holder(json.dumps(current)) if fresh else None


def lock_for(root: Location) -> FileLock | LeaseLock:
    return FileLock(root) if isinstance(root, Path) else LeaseLock(root)


def acquire(lock: FileLock | LeaseLock, launch: str, run_id: str, wait_s: float,
            root: Location) -> None:
    """Take the lock, waiting up to `wait_s` for another launch of this run to let go (a
    requeued job whose predecessor is still saving); a UserError naming the holder after that."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = lock.try_acquire(launch, run_id)
        if holder is None:
            return
        if time.monotonic() >= deadline:
            raise UserError(
                f"the checkpoint location {root} is in use by {holder}: two launches must never "
                f"save into one location at once (waited {wait_s:g} s for it to finish). Stop "
                "that launch first, or give this run a location of its own (checkpoint.uri).")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def launch_id() -> str:
    """The same in every attempt of one launch (the elastic agent's run id survives restarts);
    this process otherwise."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}@{socket.gethostname()}"
