"""Is the held-out split disjoint from what a run trained on — by content, not only by index?

Indices prove little: the same text can sit in both splits (a duplicated document, a file copied
twice into a corpus folder). So every trained sequence and every held-out sequence is read by its
tokens, and
- an **exact duplicate** is a held-out sequence whose tokens (BLAKE2b of the ids) equal a trained
  one's;
- a **near-duplicate** is a held-out sequence whose n-token shingles occur in the trained
  sequences at a share (its *containment*) at or above a threshold. Containment, not pairwise
  similarity of windows: packed sequences cut text at arbitrary offsets, so a copied passage
  sits in the two splits shifted against each other, and two shifted windows can share half
  their text or less while every n-gram of the held-out one was trained on. The trained
  sequence that shares the most shingles is named with it.

The trained shingles are kept as one sorted array of 64-bit hashes (8 bytes per trained token).
Beyond `SHINGLE_LIMIT` hashes a fixed 1-in-k subset by hash value is kept instead (the same
subset of every sequence, so shares stay comparable), and every held-out sequence that subset
flags is then measured exactly against all trained shingles in a second pass: a reported
containment is never an estimate.

Numpy only: the caller (`shardwise.study.audit`) reads the ledger and the token arrays.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SHINGLE = 8  # tokens per shingle
THRESHOLD = 0.5  # containment that counts as a near-duplicate
SHINGLE_LIMIT = 1 << 25  # trained shingle hashes kept in full (256 MiB)


@dataclass(frozen=True)
class Match:
    held_out: int  # index in the held-out split
    trained: int  # sequence id in the training split
    similarity: float  # 1.0 for an exact duplicate


@dataclass
class LeakageReport:
    held_out: int  # held-out sequences checked
    evaluated: int  # of which the first `evaluated` are what `eval` scores
    trained: int  # distinct trained sequences
    exact: list[Match] = field(default_factory=list)
    near: list[Match] = field(default_factory=list)
    held_out_repeats: int = 0  # held-out sequences that repeat another held-out one
    method: dict[str, Any] = field(default_factory=dict)
    near_checked: bool = True  # False: samples without tokens (exact duplicates only)

    @property
    def passed(self) -> bool:
        return not self.exact and not self.near

    def in_evaluated(self, matches: list[Match]) -> list[Match]:
        return [m for m in matches if m.held_out < self.evaluated]


def digest(row: np.ndarray) -> bytes:
    """The content hash of one sequence: its token ids as little-endian int64."""
    return hashlib.blake2b(np.ascontiguousarray(row, dtype="<i8").tobytes(),
                           digest_size=16).digest()


def shingles(rows: np.ndarray, n: int) -> np.ndarray:
    """(rows, L - n + 1) uint64: a mixed 64-bit hash of every n-token window of every row."""
    rows = np.asarray(rows, dtype=np.int64).astype(np.uint64)
    width = rows.shape[1] - n + 1
    if width < 1:
        raise ValueError(f"sequences of {rows.shape[1]} tokens have no {n}-token shingle")
    h = np.zeros((rows.shape[0], width), dtype=np.uint64)
    for k in range(n):
        h = h * np.uint64(1099511628211) + rows[:, k:k + width] + np.uint64(1)
    return _mix(h)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every input bit moves every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def audit_tokens(held_out: np.ndarray, evaluated: int, trained_ids: np.ndarray,
                 fetch: Callable[[np.ndarray], np.ndarray], threshold: float = THRESHOLD,
                 shingle: int = SHINGLE, chunk: int = 4096) -> LeakageReport:
    """Audit token sequences: `held_out` (m, L) ids; `trained_ids` the distinct trained sequence
    ids; `fetch(ids)` their (k, L) rows, read `chunk` at a time."""
    width = held_out.shape[1] - shingle + 1
    every = max(1, math.ceil(len(trained_ids) * width / SHINGLE_LIMIT))
    report = LeakageReport(held_out=len(held_out), evaluated=evaluated, trained=len(trained_ids),
                           method={"hash": "blake2b-128 of int64 token ids", "shingle": shingle,
                                   "threshold": threshold, "measure": "containment",
                                   "first_pass_sample": f"1 in {every}"})
    held_digests = [digest(r) for r in held_out]
    report.held_out_repeats = len(held_digests) - len(set(held_digests))
    where: dict[bytes, list[int]] = {}
    for i, d in enumerate(held_digests):
        where.setdefault(d, []).append(i)
    held_shingles = [np.unique(row) for row in shingles(held_out, shingle)]
    kept: list[np.ndarray] = []
    for ids, rows in _chunks(trained_ids, fetch, chunk):
        for sid, row in zip(ids.tolist(), rows, strict=True):
            report.exact += [Match(i, sid, 1.0) for i in where.get(digest(row), ())]
        kept = _merge(kept, _sampled(shingles(rows, shingle).ravel(), every))
    trained = np.unique(np.concatenate(kept)) if kept else np.zeros(0, np.uint64)
    exact = {m.held_out for m in report.exact}
    flagged = [i for i, sh in enumerate(held_shingles) if i not in exact
               and _share(_sampled(sh, every), trained) >= threshold]
    report.near = _measure(flagged, held_shingles, trained_ids, fetch, chunk, shingle, threshold)
    report.exact.sort(key=lambda m: (m.held_out, m.trained))
    report.near.sort(key=lambda m: (-m.similarity, m.held_out))
    return report


def _chunks(ids: np.ndarray, fetch: Callable[[np.ndarray], np.ndarray], chunk: int
            ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for lo in range(0, len(ids), chunk):
        part = np.asarray(ids[lo:lo + chunk])
        yield part, fetch(part)


def _sampled(hashes: np.ndarray, every: int) -> np.ndarray:
    """The fixed 1-in-`every` subset of shingle hashes (all of them when every = 1)."""
    return hashes if every == 1 else hashes[hashes % np.uint64(every) == 0]


def _merge(kept: list[np.ndarray], new: np.ndarray) -> list[np.ndarray]:
    """Sorted unique hashes: `kept[0]` is merged, the rest are pending chunks; they are merged
    once they outgrow it (amortised n log n, memory near the distinct count)."""
    kept = [*kept, np.unique(new)]
    if len(kept) > 1 and sum(k.size for k in kept[1:]) >= kept[0].size:
        kept = [np.unique(np.concatenate(kept))]
    return kept


def _share(row: np.ndarray, trained: np.ndarray) -> float:
    """The share of a held-out row's (unique) shingles found among the trained ones."""
    if row.size == 0:
        return 0.0
    at = np.searchsorted(trained, row)
    found = at < trained.size
    found[found] = trained[at[found]] == row[found]
    return float(found.mean())


def _measure(flagged: list[int], held_shingles: list[np.ndarray], trained_ids: np.ndarray,
             fetch: Callable[[np.ndarray], np.ndarray], chunk: int, shingle: int,
             threshold: float) -> list[Match]:
    """Exact containment of each flagged held-out row in all trained shingles, and the trained
    sequence sharing most of its shingles (a second pass over the trained sequences)."""
    if not flagged:
        return []
    owners: dict[int, list[int]] = {}  # shingle -> the flagged rows that have it
    for i in flagged:
        for h in held_shingles[i].tolist():
            owners.setdefault(h, []).append(i)
    pool = np.fromiter(owners, dtype=np.uint64, count=len(owners))
    found: dict[int, set[int]] = {i: set() for i in flagged}
    best: dict[int, tuple[int, int]] = {}  # held-out row -> (shared shingles, trained id)
    for ids, rows in _chunks(trained_ids, fetch, chunk):
        sh = shingles(rows, shingle)
        hits = np.isin(sh, pool)
        for j in np.flatnonzero(hits.any(axis=1)):
            shared: dict[int, int] = {}
            for h in set(sh[j][hits[j]].tolist()):
                for i in owners[h]:
                    found[i].add(h)
                    shared[i] = shared.get(i, 0) + 1
            for i, count in shared.items():
                if count > best.get(i, (0, -1))[0]:
                    best[i] = (count, int(ids[j]))
    out = []
    for i in flagged:
        share = len(found[i]) / held_shingles[i].size
        if share >= threshold and i in best:
            out.append(Match(i, best[i][1], round(share, 4)))
    return out


def audit_digests(held_out: list[bytes], evaluated: int, trained: dict[bytes, int]
                  ) -> LeakageReport:
    """Samples that are not token sequences: exact duplicates only (`trained`: digest -> the
    first trained sample id with it)."""
    report = LeakageReport(held_out=len(held_out), evaluated=evaluated, trained=len(trained),
                           near_checked=False,
                           method={"hash": "blake2b-128 of each sample's canonical bytes"})
    report.held_out_repeats = len(held_out) - len(set(held_out))
    report.exact = [Match(i, trained[d], 1.0) for i, d in enumerate(held_out) if d in trained]
    return report
