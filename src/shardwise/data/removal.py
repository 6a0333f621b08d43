"""Data-removal requests: which derived caches of a dataset were deleted, when, why and by whom,
and the refusal a run meets when it needs them again.

What shardwise derives from a text dataset lives in CACHE_ROOT/corpus-<content sha256[:16]>/ (the
BPE tokenizer trained on it, the token arrays, their parts and sidecars; see `data.prepare`).
`shardwise gc --data` deletes that directory and appends one JSON line to
CACHE_ROOT/deletions.jsonl: `{"kind": "delete", "content_sha256", "source", "deleted": [{"path",
"bytes"}], "when", "why", "by"}`. The line is also a tombstone: preparing data whose content hash
it names is refused (one paragraph saying when, why and by whom, and how to allow a rebuild)
instead of silently rebuilding the caches from a corpus that was to be forgotten. `gc
--allow-rebuild` appends `{"kind": "allow-rebuild", ...}`, after which the next run rebuilds.
The log is append-only; the newest line about a hash decides.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardwise.errors import UserError

LOG = "deletions.jsonl"
KEY_CHARS = 16  # the cache directory is named by this many hex digits of the content hash


def cache_dir(root: Path, content_hash: str) -> Path:
    """Where the derived caches of the text dataset with this content hash are."""
    return root / f"corpus-{content_hash[:KEY_CHARS]}"


def records(root: Path) -> list[dict[str, Any]]:
    path = root / LOG
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line a crash cut short: the ones before it stand
    return out


def append(root: Path, record: dict[str, Any]) -> None:
    """One line, flushed and fsync'd: the record outlives a crash right after the deletion."""
    import os

    root.mkdir(parents=True, exist_ok=True)
    with (root / LOG).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def blocking(root: Path, content_hash: str) -> dict[str, Any] | None:
    """The deletion record that forbids rebuilding this dataset's caches, or None."""
    key = content_hash[:KEY_CHARS]
    last = None
    for record in records(root):
        if str(record.get("content_sha256", ""))[:KEY_CHARS] == key:
            last = record
    return last if last is not None and last.get("kind") == "delete" else None


def check_not_removed(root: Path, content_hash: str, source: str) -> None:
    """Refuse to prepare a dataset whose derived caches a data-removal request deleted."""
    record = blocking(root, content_hash)
    if record is None:
        return
    raise UserError(
        f"the derived caches of data.source {source!r} (content sha256 "
        f"{content_hash[:KEY_CHARS]}…: its tokenizer and token arrays) were deleted on "
        f"{record.get('when')} by {record.get('by')} for a data-removal request "
        f"({record.get('why')!r}; recorded in {root / LOG}), and this run needs them. If the "
        "data may be used again, allow the rebuild with `shardwise gc --allow-rebuild "
        f"{content_hash[:KEY_CHARS]} --reason TEXT` and run again (the caches are rebuilt from "
        "the corpus); otherwise point data.source at another dataset.")
