"""The sample ledger: which global sample indices each rank consumed at each step, and the audit
that proves every sample of every step was used exactly once — restarts and resumes included.

Files under RUN_DIR/ledger/:
- `launches.jsonl`: one line per launch, `{"launch": n, "start_step": k, "world_size": w}`;
- `rank-NNNNN.jsonl`: one line per step and rank, `{"launch": n, "step": s, "ranges": [[a, b)...]}`.

A step s is owned by the newest launch that started before it (start_step < s): a launch that
crashed after its checkpoint is superseded for the steps the next launch ran again, because those
updates were thrown away with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LEDGER_DIR = "ledger"
LAUNCHES = "launches.jsonl"


def to_ranges(indices: np.ndarray) -> list[list[int]]:
    """Sorted half-open ranges [a, b) covering `indices` (duplicates kept as separate ranges)."""
    out: list[list[int]] = []
    for i in np.sort(np.asarray(indices, dtype=np.int64)).tolist():
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


class LedgerWriter:
    """Appends this rank's consumption, one flushed line per step (a crash loses nothing written)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.dir = run_dir / LEDGER_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.launch = 0
        self._file = (self.dir / f"rank-{rank:05d}.jsonl").open("a", encoding="utf-8")

    def count_launches(self) -> None:
        """Every rank reads the number of this launch before rank 0 appends it (a barrier must
        separate the two calls)."""
        path = self.dir / LAUNCHES
        self.launch = len(path.read_text().splitlines()) if path.exists() else 0

    def start_launch(self, start_step: int, world_size: int,
                     skipped: tuple[int, int] | None = None) -> None:
        """Rank 0 records the launch; `skipped` declares samples [a, b) deliberately never
        trained on (a rollback past batches that made training diverge)."""
        if self.rank == 0:
            record = {"launch": self.launch, "start_step": start_step, "world_size": world_size}
            if skipped is not None:
                record["skipped"] = list(skipped)
            with (self.dir / LAUNCHES).open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def record(self, step: int, micro_batches: list[np.ndarray]) -> None:
        indices = np.concatenate(micro_batches) if micro_batches else np.zeros(0, np.int64)
        self._file.write(json.dumps({"launch": self.launch, "step": step,
                                     "ranges": to_ranges(indices)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass
class LedgerReport:
    steps: int = 0
    samples: int = 0
    launches: int = 0
    skipped: int = 0  # samples declared skipped by a rollback
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.problems and self.steps > 0


def audit(run_dir: Path) -> LedgerReport:
    """Check that steps 1..last each used a contiguous block of global indices, every index of
    it exactly once across ranks, and that consecutive steps leave no gap and no overlap."""
    ledger = run_dir / LEDGER_DIR
    launches = [json.loads(line) for line in (ledger / LAUNCHES).read_text().splitlines()]
    starts = {entry["launch"]: entry["start_step"] for entry in launches}
    declared = {entry["skipped"][0]: entry["skipped"][1] for entry in launches
                if "skipped" in entry}
    records: dict[tuple[int, int], list[tuple[int, list[list[int]]]]] = {}
    for path in sorted(ledger.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            records.setdefault((entry["launch"], entry["step"]), []).append((rank, entry["ranges"]))
    report = LedgerReport(launches=len(launches))
    last_launch = max(starts)
    last_step = max((s for (launch, s) in records if launch == last_launch), default=0)
    expected_start = 0
    for step in range(1, last_step + 1):
        owner = max(launch for launch, start in starts.items() if start < step)
        entries = records.get((owner, step), [])
        if not entries:
            report.problems.append(f"step {step}: no rank recorded it in launch {owner}")
            continue
        seen: dict[int, int] = {}
        for rank, ranges in entries:
            for a, b in ranges:
                for i in range(a, b):
                    if i in seen:
                        report.problems.append(f"step {step}: sample {i} used twice (ranks "
                                               f"{seen[i]} and {rank})")
                    seen[i] = rank
        lo, hi = min(seen), max(seen) + 1
        while expected_start in declared and expected_start != lo:
            report.skipped += declared[expected_start] - expected_start
            expected_start = declared[expected_start]
        if lo != expected_start:
            kind = "skipped" if lo > expected_start else "repeated"
            report.problems.append(f"step {step}: starts at sample {lo}, but the previous step "
                                   f"ended at {expected_start}: samples {kind}")
        missing = sorted(set(range(lo, hi)) - seen.keys())
        if missing:
            report.problems.append(f"step {step}: samples {missing[:5]} inside the step were "
                                   "never used")
        expected_start = hi
        report.steps += 1
        report.samples += len(seen)
    return report
