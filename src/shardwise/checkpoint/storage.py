"""Where checkpoints live: a local directory or an S3-compatible bucket, behind one interface.

The checkpointer asks a `Storage` for locations, DCP readers and writers, small synced writes,
listings, the commit and removals; only this module knows the scheme. A location is a
`pathlib.Path` on disk and a `RemotePath` (a small path-like over fsspec) on object storage, so
code that reads a checkpoint — manifest lineage, fault drills, the resume messages — works on both
without asking which it has.

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
- Object storage has no rename: a "rename" is a copy of every byte followed by deletes, and is not
  atomic either. What it does have is an atomic PUT per object and read-after-write consistency (AWS
  S3 since 2020, MinIO, Ceph, s3rver). So the shards go straight to `step-N/` and `meta.json`, which
  lists every file with its size and SHA-256, is PUT last: a prefix without it, or whose objects do
  not match it, is never loaded. Re-saving a step deletes its `meta.json` first, so the old
  checkpoint stops counting before any of its objects change; retention deletes `meta.json` first
  for the same reason. So, unlike on disk, re-saving a step that exists is not atomic: from the
  start of the new save until its commit, that step has no valid checkpoint (a crash in between
  leaves the next older one as the newest valid checkpoint). Staging on local disk and uploading
  afterwards was rejected: it doubles the I/O and needs local room for a whole shard, and the upload
  would still depend on the same meta-last rule for its atomicity.

Credentials never go in the spec (it is copied into every checkpoint): they come from the
environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN), a named profile of
~/.aws/credentials (`checkpoint.profile`), or the rest of botocore's default chain.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fnmatch
import functools
import io
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from shardwise.checkpoint.staging import HostStager
from shardwise.compat import fsspec_reader, fsspec_writer
from shardwise.errors import UserError
from shardwise.utils.files import atomic_write_text

META = "meta.json"
LOCATION_FILE = "location.json"  # in RUN_DIR/checkpoints when the checkpoints live elsewhere
STEP_DIR = re.compile(r"^step-(\d{6,})$")
REPLACED = ".replaced"  # the old step-N while a re-save without renameat2 swaps in the new one
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


# --- staging: the copy to host memory that an async save waits for ---------------------------
class _HostCopyStage:
    """Mixin for DCP writers: `dcp.async_save` stages through the writer's `stage()`, here into
    the host buffers of the checkpointer's `HostStager` (one for the writer alone without it)."""

    stager: HostStager | None = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.stager is None:
            self.stager = HostStager()
        return self.stager.stage(state_dict)


class _LocalWriter(_HostCopyStage, FileSystemWriter):
    pass


# --- object storage paths -----------------------------------------------------------------------
class RemotePath:
    """The part of the pathlib API that checkpoint code uses, over an fsspec filesystem.

    `str()` gives the URI (`s3://bucket/key`); object stores have no directories, so a "directory"
    is a key prefix, `mkdir` does nothing and a prefix exists while any object is under it.
    """

    def __init__(self, fs: Any, key: str, scheme: str = "s3") -> None:
        self.fs, self.key, self.scheme = fs, key.strip("/"), scheme

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: RemotePath) -> bool:
        return str(self) < str(other)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.fs, f"{self.key}/{name}", self.scheme)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.key.rsplit("/", 1)[0], self.scheme)

    def relative_to(self, other: RemotePath) -> str:
        return self.key[len(other.key):].lstrip("/")

    def exists(self) -> bool:
        return bool(self.fs.exists(self.key))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.key))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.key))

    def iterdir(self) -> list[RemotePath]:
        try:
            return [RemotePath(self.fs, k, self.scheme) for k in self.fs.ls(self.key, detail=False)]
        except FileNotFoundError:
            return []

    def glob(self, pattern: str) -> list[RemotePath]:
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.size(self.key)))

    def open(self, mode: str = "rb") -> BinaryIO:
        return self.fs.open(self.key, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.key))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        self.fs.pipe_file(self.key, data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object stores have no directories."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise


Location = Path | RemotePath


# --- the storage interface ------------------------------------------------------------------------
class Storage:
    """A local directory of checkpoints (the default). Subclasses override what differs."""

    def __init__(self, root: Path) -> None:
        self.root: Location = root

    def staging(self, final: Location) -> Location:
        """Where a save writes before it is committed to `final`."""
        assert isinstance(final, Path)
        return final.with_name(f"{final.name}.staging")

    def prepare(self, staging: Location, final: Location) -> None:
        """Rank 0, before a save: drop a stale staging directory and create an empty one."""
        assert isinstance(staging, Path)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)

    def writer(self, location: Location, stager: HostStager | None = None) -> Any:
        """A DCP writer for `location`; an async save stages through `stager`."""
        writer = _LocalWriter(str(location))
        writer.stager = stager
        return writer

    def reader(self, location: Location) -> Any:
        return FileSystemReader(str(location))

    def write_file(self, location: Location, data: bytes) -> None:
        """Write a small file durably (fsync'd)."""
        assert isinstance(location, Path)
        location.parent.mkdir(parents=True, exist_ok=True)
        with location.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def commit(self, staging: Location, final: Location, meta_text: str) -> None:
        """Rank 0, after every rank's files are written and hashed: meta.json last, then rename."""
        assert isinstance(staging, Path) and isinstance(final, Path)
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
        if not isinstance(root, Path) or not root.is_dir():
            return
        for old in root.glob(f"step-*{REPLACED}"):
            final = old.with_name(old.name[: -len(REPLACED)])
            if not STEP_DIR.match(final.name):
                continue
            if final.exists():  # the crash came after the new step-N was in place
                shutil.rmtree(old, ignore_errors=True)
                continue
            with contextlib.suppress(FileNotFoundError):  # another process recovered it first
                os.rename(old, final)
                _fsync_dir(root)

    def remove(self, location: Location) -> None:
        """Delete a checkpoint, meta.json first so that a half-deleted one never verifies."""
        assert isinstance(location, Path)
        (location / META).unlink(missing_ok=True)
        shutil.rmtree(location, ignore_errors=True)

    def step_dirs(self) -> list[Location]:
        """Every `step-N` directory (complete or not), in no particular order."""
        root = self.root
        if not isinstance(root, Path) or not root.is_dir():
            return []
        return [p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()]


class ObjectStorage(Storage):
    """Checkpoints under an S3-compatible prefix, through fsspec/s3fs (see the module docstring
    for why meta.json written last, and not a rename, is the commit).

    Re-saving a step that already exists is not atomic: the new save deletes the old save of that
    step when it starts (`prepare`), so until its own meta.json is PUT that step has no valid
    checkpoint, and if the new save fails or the job dies in between, the old one is gone — the
    loader then falls back to the next older valid checkpoint."""

    def __init__(self, uri: str, fs: Any, storage_options: dict[str, Any]) -> None:
        scheme, _, key = uri.partition("://")
        self.uri, self.fs, self.storage_options = uri, fs, storage_options
        self.root = RemotePath(fs, key, scheme)

    def staging(self, final: Location) -> Location:
        return final  # no rename: meta.json written last is the commit

    def prepare(self, staging: Location, final: Location) -> None:
        self.remove(final)  # a stale partial save, or an earlier save of the same step

    def writer(self, location: Location, stager: HostStager | None = None) -> Any:
        writer = _fsspec_writer_class()(str(location), **self.storage_options)
        writer.stager = stager
        return writer

    def reader(self, location: Location) -> Any:
        return fsspec_reader()(str(location), **self.storage_options)

    def write_file(self, location: Location, data: bytes) -> None:
        location.write_bytes(data)  # one PUT: atomic and durable once it returns

    def commit(self, staging: Location, final: Location, meta_text: str) -> None:
        """meta.json, PUT last, is the commit. A re-save of an existing step is not atomic here
        (see the module docstring): `prepare` already deleted the old save of this step."""
        (final / META).write_text(meta_text)

    def recover(self) -> None:
        """Nothing to put back: object storage never renames."""

    def remove(self, location: Location) -> None:
        assert isinstance(location, RemotePath)
        (location / META).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(location.key, recursive=True)

    def step_dirs(self) -> list[Location]:
        root = self.root
        assert isinstance(root, RemotePath)
        try:
            entries = self.fs.ls(root.key, detail=True)
        except FileNotFoundError:
            return []
        return [RemotePath(self.fs, e["name"], root.scheme) for e in entries
                if e.get("type") == "directory" and STEP_DIR.match(e["name"].rsplit("/", 1)[-1])]


_WRITER: type | None = None


def _fsspec_writer_class() -> type:
    global _WRITER
    if _WRITER is None:
        _WRITER = type("_RemoteWriter", (_HostCopyStage, fsspec_writer()), {})
    return _WRITER


# --- listing and reading, for verification --------------------------------------------------------
def list_files(directory: Location) -> dict[str, int]:
    """{relative path: size} of every file of a checkpoint except meta.json (one listing)."""
    if isinstance(directory, RemotePath):
        try:
            found = directory.fs.find(directory.key, detail=True)
        except FileNotFoundError:
            return {}
        return {RemotePath(directory.fs, k).relative_to(RemotePath(directory.fs, directory.key)):
                int(info["size"]) for k, info in found.items()
                if info.get("type") == "file" and not k.endswith(f"/{META}")}
    if not directory.is_dir():
        return {}
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")
            if p.is_file() and p.name != META}


def read_torch(location: Location) -> Any:
    """A small torch-saved object (rng state), loaded without unpickling arbitrary objects."""
    return torch.load(io.BytesIO(location.read_bytes()), weights_only=True)


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- opening a storage from the spec --------------------------------------------------------------
@dataclass(frozen=True)
class StorageSpec:
    """What locates the checkpoints: a URI ("" = the run's own directory) and, for S3, the
    endpoint, region and profile. Nothing secret: it is written to RUN_DIR/checkpoints."""

    uri: str = ""
    endpoint_url: str = ""
    region: str = ""
    profile: str = ""

    @classmethod
    def from_section(cls, section: Any) -> StorageSpec:
        return cls(section.uri, section.endpoint_url, section.region, section.profile)


def open_storage(spec: StorageSpec, local_root: Path) -> Storage:
    """The storage `spec` names; `local_root` (RUN_DIR/checkpoints) when it names none."""
    uri = spec.uri.strip()
    if not uri:
        return Storage(local_root)
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return Storage(Path(uri).expanduser())
    if scheme == "file":
        return Storage(Path(rest).expanduser())
    if scheme != "s3":
        raise UserError(f"checkpoint.uri = {uri!r}: the scheme {scheme!r} is not supported. Use "
                        "s3://BUCKET/PREFIX for S3-compatible storage, or a local directory.")
    return _open_s3(uri, spec)


def follow_location(local_root: Path) -> Storage:
    """The storage of a run's checkpoints as recorded in RUN_DIR/checkpoints/location.json, or the
    local directory itself. Lets code that knows only the run directory (restart detection, the
    CLI's resume check) find checkpoints that live in a bucket."""
    pointer = local_root / LOCATION_FILE
    if not pointer.is_file():
        return Storage(local_root)
    try:
        recorded = json.loads(pointer.read_text())
        spec = StorageSpec(**{k: str(recorded.get(k, "")) for k in
                              ("uri", "endpoint_url", "region", "profile")})
    except (json.JSONDecodeError, TypeError, AttributeError) as err:
        raise UserError(f"{pointer} is unreadable ({err}); it records where this run's "
                        "checkpoints live. Restore it, or delete it if they are in "
                        f"{local_root}.") from None
    return open_storage(spec, local_root)


def record_location(spec: StorageSpec, storage: Storage, local_root: Path) -> None:
    """Rank 0: write (or remove) RUN_DIR/checkpoints/location.json for `follow_location`."""
    pointer = local_root / LOCATION_FILE
    if isinstance(storage.root, Path) and storage.root.resolve() == local_root.resolve():
        pointer.unlink(missing_ok=True)
        return
    atomic_write_text(pointer, json.dumps({"uri": spec.uri, "endpoint_url": spec.endpoint_url,
                                           "region": spec.region, "profile": spec.profile},
                                          indent=2) + "\n")


def s3_options(spec: StorageSpec) -> dict[str, Any]:
    """fsspec storage options for s3fs. The endpoint falls back to $AWS_ENDPOINT_URL_S3 and
    $AWS_ENDPOINT_URL (botocore reads them too; naming it here lets errors say which one)."""
    options: dict[str, Any] = {
        "use_listings_cache": False,  # other ranks and processes write the same prefixes
        "skip_instance_cache": True,  # credentials are read when a client is made, not cached
        "config_kwargs": {"connect_timeout": 10, "read_timeout": 120,
                          "retries": {"max_attempts": 3, "mode": "standard"}},
    }
    endpoint = (spec.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or "")
    if endpoint:
        options["endpoint_url"] = endpoint
    if spec.region:
        options["client_kwargs"] = {"region_name": spec.region}
    if spec.profile:
        options["profile"] = spec.profile
    return options


def _open_s3(uri: str, spec: StorageSpec) -> ObjectStorage:
    bucket = uri[len("s3://"):].split("/", 1)[0]
    if not _BUCKET.match(bucket):
        raise UserError(f"checkpoint.uri = {uri!r} does not name a valid bucket ({bucket!r}); "
                        "write s3://BUCKET/PREFIX with a bucket name of 3-63 lowercase letters, "
                        "digits, dots or hyphens.")
    try:
        import s3fs
    except ImportError:
        raise UserError(f"checkpoint.uri = {uri!r} needs the s3fs package, which is not "
                        "installed. Install it with `pip install 'shardwise[s3]'` (or "
                        "`pip install s3fs`), or leave checkpoint.uri empty to keep checkpoints "
                        "in the run directory.") from None
    options = s3_options(spec)
    endpoint = options.get("endpoint_url", "the default AWS endpoint")
    try:
        fs = s3fs.S3FileSystem(**options)
        fs.call_s3("head_bucket", Bucket=bucket)
    except Exception as err:  # classified below; anything else is reported with its own text
        raise UserError(_s3_problem(err, uri, bucket, endpoint)) from None
    return ObjectStorage(uri, fs, options)


def _s3_problem(err: Exception, uri: str, bucket: str, endpoint: str) -> str:
    name = type(err).__name__
    if name == "NoCredentialsError":
        return (f"no S3 credentials for checkpoint.uri = {uri!r}. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment of every rank, or name a profile of "
                "~/.aws/credentials with checkpoint.profile (credentials never go in the spec: it "
                "is copied into every checkpoint).")
    if name == "ProfileNotFound":
        return (f"checkpoint.profile: {err}. Name a profile that exists in ~/.aws/credentials or "
                "~/.aws/config, or leave checkpoint.profile empty to use AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY.")
    if isinstance(err, PermissionError):
        return (f"the S3 server at {endpoint} refused access to bucket {bucket!r} ({err}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or checkpoint.profile) and that they "
                f"may list, read, write and delete under {uri}.")
    if isinstance(err, FileNotFoundError):
        return (f"bucket {bucket!r} does not exist at {endpoint}. Create it first (e.g. `aws s3 mb "
                f"s3://{bucket}`), or correct checkpoint.uri.")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ClientConnectorError", "ConnectionError") or isinstance(err, OSError):
        return (f"cannot reach the S3 endpoint {endpoint} for checkpoint.uri = {uri!r} ({err}). "
                "Check checkpoint.endpoint_url (or $AWS_ENDPOINT_URL): scheme, host and port, and "
                "that the server is running and reachable from every rank.")
    if name == "ValueError" or "endpoint" in str(err).lower():
        return (f"checkpoint.endpoint_url / $AWS_ENDPOINT_URL ({endpoint}) is not usable: {err}. "
                "Write it as http://HOST:PORT or https://HOST.")
    return (f"S3 check of checkpoint.uri = {uri!r} at {endpoint} failed: {name}: {err}. Check the "
            "endpoint, the credentials and the bucket.")


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
