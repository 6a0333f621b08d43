"""Where a checkpoint's files are: a `pathlib.Path` on disk or a `RemotePath` on object storage.

`RemotePath` is the small part of the pathlib API that checkpoint code uses, over an fsspec
filesystem, so code that reads a checkpoint (integrity checks, manifest lineage, fault drills, the
resume messages) works on both without asking which it has. Torch-free.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, BinaryIO

from shardwise.checkpoint.layout import META
from shardwise.utils.redact import redact


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

    def record(self) -> dict[str, str]:
        """What RUN_DIR/checkpoints/location.json keeps: every field, with any credentials in
        a URI redacted (the RunSpec refuses them; this guards a StorageSpec made elsewhere)."""
        return {name: redact(value) for name, value in dataclasses.asdict(self).items()}


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

