"""Where checkpoints live: a local directory or an S3-compatible bucket, behind one interface.

The checkpointer asks a `Storage` (a protocol: `LocalStorage` here, `ObjectStorage` in
`object_storage`) for locations, DCP readers and writers, small synced writes, listings, the
commit and removals; only the implementations know the scheme. Locations are `pathlib.Path` on
disk and `RemotePath` on object storage (`shardwise.checkpoint.location`); the names are in
`shardwise.checkpoint.layout`.

How a checkpoint becomes valid (the loader's rule everywhere: a `step-N` directory counts only if
its `meta.json` exists and every file it lists has the recorded size and SHA-256):

- Disk: everything is written under `step-N.staging/`, each file fsync'd, `meta.json` written last,
  then the directory is renamed to `step-N/` and the parent fsync'd. A rename is atomic, so a crash
  leaves at most a `.staging` directory, which the loader never looks at. Re-saving a step that
  exists (e.g. `stop_at` on a cadence step, a step re-run after a rollback) must not delete the old
  `step-N/` before the new one is in place: on Linux the two directories are swapped in one
  `renameat2(RENAME_EXCHANGE)` and the old one, now under the staging name, is deleted. Where that
  call is missing (another OS, an old libc) or the filesystem refuses it (EINVAL: some network and
  FUSE filesystems), the old directory is renamed to `step-N.replaced`, the staging directory to
  `step-N`, and `.replaced` deleted; a crash between the two renames leaves `.replaced` without
  `step-N`, which `recover()` (rank 0, before the checkpoints are listed) renames back.
- Object storage (`shardwise.checkpoint.object_storage`) has no rename: there `meta.json`, PUT
  last, is the commit.

"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import io
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from shardwise.checkpoint.layout import LOCATION_FILE, META, REPLACED, STAGING, step_of
from shardwise.checkpoint.location import Location, RemotePath, StorageSpec, list_files
from shardwise.checkpoint.object_storage import open_s3
from shardwise.checkpoint.staging import HostCopyStage, HostStager
from shardwise.errors import UserError
from shardwise.utils.files import atomic_write_text

__all__ = ["LOCATION_FILE", "META", "LocalStorage", "Location", "RemotePath", "Storage", "StorageSpec",
           "follow_location", "list_files", "open_storage", "read_torch", "record_location",
           "torch_bytes"]


class _LocalWriter(HostCopyStage, FileSystemWriter):
    pass


L = TypeVar("L", Path, RemotePath)


class Storage(Protocol[L]):
    """Where a run's checkpoints are committed; `L` is its location type."""

    root: L

    def staging(self, final: L) -> L:
        """Where a save writes before it is committed to `final`."""

    def prepare(self, staging: L, final: L) -> None:
        """Rank 0, before a save: make `staging` empty and ready."""

    def writer(self, location: L, stager: HostStager | None = None) -> Any:
        """A DCP writer for `location`; an async save stages through `stager`."""

    def reader(self, location: L) -> Any:
        """A DCP reader for `location`."""

    def write_file(self, location: L, data: bytes) -> None:
        """Write a small file durably."""

    def commit(self, staging: L, final: L, meta_text: str) -> None:
        """Rank 0, after every rank's files are written and hashed: make `final` count."""

    def recover(self) -> None:
        """Rank 0, before listing: undo what a crash in the middle of a commit left."""

    def remove(self, location: L) -> None:
        """Delete a checkpoint so that a half-deleted one never verifies."""

    def step_dirs(self) -> list[L]:
        """Every `step-N` directory (complete or not), in no particular order."""


# --- local disk -----------------------------------------------------------------------------------
class LocalStorage:
    """A local directory of checkpoints (the default)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def staging(self, final: Path) -> Path:
        """Where a save writes before it is committed to `final`."""
        return final.with_name(final.name + STAGING)

    def prepare(self, staging: Path, final: Path) -> None:
        """Rank 0, before a save: drop a stale staging directory and create an empty one."""
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)

    def writer(self, location: Path, stager: HostStager | None = None) -> Any:
        """A DCP writer for `location`; an async save stages through `stager`."""
        writer = _LocalWriter(str(location))
        writer.stager = stager
        return writer

    def reader(self, location: Path) -> Any:
        return FileSystemReader(str(location))

    def write_file(self, location: Path, data: bytes) -> None:
        """Write a small file durably (fsync'd)."""
        location.parent.mkdir(parents=True, exist_ok=True)
        with location.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, staging: Path, final: Path, meta_text: str) -> None:
        """Rank 0, after every rank's files are written and hashed: meta.json last, then rename."""
        for directory in sorted({p.parent for p in staging.rglob("*") if p.is_file()}):
            _fsync_dir(directory)  # the files' directory entries, not just their bytes
        atomic_write_text(staging / META, meta_text)
        if final.exists():  # the same step saved again (e.g. stop_at == a cadence step)
            _replace_dir(staging, final)
        else:
            os.replace(staging, final)
        _fsync_dir(final.parent)

    def recover(self) -> None:
        """Rank 0, before listing: put back a `step-N` that a crash left as `step-N.replaced`
        between the two renames of a re-save (and drop a `.replaced` whose `step-N` is back)."""
        root = self.root
        if not root.is_dir():
            return
        for old in root.glob(f"step-*{REPLACED}"):
            final = old.with_name(old.name[: -len(REPLACED)])
            if step_of(final) is None:
                continue
            if final.exists():  # the crash came after the new step-N was in place
                shutil.rmtree(old, ignore_errors=True)
                continue
            with contextlib.suppress(FileNotFoundError):  # another process recovered it first
                os.rename(old, final)
                _fsync_dir(root)

    def remove(self, location: Path) -> None:
        """Delete a checkpoint, meta.json first so that a half-deleted one never verifies."""
        (location / META).unlink(missing_ok=True)
        shutil.rmtree(location, ignore_errors=True)

    def step_dirs(self) -> list[Path]:
        """Every `step-N` directory (complete or not), in no particular order."""
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if step_of(p) is not None and p.is_dir()]



def read_torch(location: Location) -> Any:
    """A small torch-saved object (rng state), loaded without unpickling arbitrary objects."""
    return torch.load(io.BytesIO(location.read_bytes()), weights_only=True)


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()

# --- opening a storage from the spec --------------------------------------------------------------
def open_storage(spec: StorageSpec, local_root: Path) -> Storage[Any]:
    """The storage `spec` names; `local_root` (RUN_DIR/checkpoints) when it names none."""
    uri = spec.uri.strip()
    if not uri:
        return LocalStorage(local_root)
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return LocalStorage(Path(uri).expanduser())
    if scheme == "file":
        return LocalStorage(Path(rest).expanduser())
    if scheme != "s3":
        raise UserError(f"checkpoint.uri = {uri!r}: the scheme {scheme!r} is not supported. Use "
                        "s3://BUCKET/PREFIX for S3-compatible storage, or a local directory.")
    return open_s3(uri, spec)


def follow_location(local_root: Path) -> Storage[Any]:
    """The storage of a run's checkpoints as recorded in RUN_DIR/checkpoints/location.json, or the
    local directory itself. Lets code that knows only the run directory (restart detection, the
    CLI's resume check) find checkpoints that live in a bucket."""
    pointer = local_root / LOCATION_FILE
    if not pointer.is_file():
        return LocalStorage(local_root)
    try:
        recorded = json.loads(pointer.read_text())
        spec = StorageSpec(**{k: str(recorded.get(k, "")) for k in
                              ("uri", "endpoint_url", "region", "profile")})
    except (json.JSONDecodeError, TypeError, AttributeError) as err:
        raise UserError(f"{pointer} is unreadable ({err}); it records where this run's "
                        "checkpoints live. Restore it, or delete it if they are in "
                        f"{local_root}.") from None
    return open_storage(spec, local_root)


def record_location(spec: StorageSpec, storage: Storage[Any], local_root: Path) -> None:
    """Rank 0: write (or remove) RUN_DIR/checkpoints/location.json for `follow_location`."""
    pointer = local_root / LOCATION_FILE
    if isinstance(storage.root, Path) and storage.root.resolve() == local_root.resolve():
        pointer.unlink(missing_ok=True)
        return
    atomic_write_text(pointer, json.dumps(spec.record(), indent=2) + "\n")



# --- replacing a committed directory -----------------------------------------------------------
RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """libc's renameat2 (glibc 2.28+), or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where the OS or filesystem cannot."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _replace_dir(staging: Path, final: Path) -> None:
    """Put `staging` in the place of the existing `final` so that a crash at any moment leaves
    one complete `final`: the old one or the new one."""
    if exchange_dirs(staging, final):
        _fsync_dir(final.parent)  # the swap is on disk before the old copy goes
        shutil.rmtree(staging, ignore_errors=True)  # the old checkpoint, under the staging name
        return
    replaced = final.with_name(final.name + REPLACED)
    shutil.rmtree(replaced, ignore_errors=True)  # a leftover whose final is complete
    os.replace(final, replaced)
    _fsync_dir(final.parent)
    os.replace(staging, final)  # a crash before this leaves only .replaced: recover() restores it
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
