"""The sample ledger: which global sample indices each rank consumed at each step, and the audit
that proves every sample of every step was used exactly once — restarts and resumes included.

Files under RUN_DIR/ledger/:
- `launches.jsonl`: one line per launch, `{"launch": n, "start_step": k, "world_size": w,
  "dp": d, "global_batch": b}` (a rollback adds `"skipped": [a, b)`, samples never to train on;
  a launch that starts a branch, `train --resume --from`, adds `"branch": {"from_step": k, ...}`);
- `rank-NNNNN.jsonl`: one line per step, written by one rank of each data-parallel replica (the
  rank at coordinate 0 of the tp, pp and cp axes: its peers read the same samples),
  `{"launch": n, "step": s, "dp_rank": r, "ranges": [[a, b)...]}`.

A step s is owned by the newest launch that started before it (start_step < s): a launch that
crashed after its checkpoint is superseded for the steps the next launch ran again, because those
updates were thrown away with it. A branch is the same case: its launch starts at the branch
point, so it owns every later step, and the abandoned line's records of them no longer count.
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
    """Appends this replica's consumption, one flushed line per step (a crash loses nothing
    written). Ranks that share a replica's data with a writer (`writes = False`) keep no file."""

    def __init__(self, run_dir: Path, rank: int, dp_rank: int = 0, writes: bool = True) -> None:
        self.dir = run_dir / LEDGER_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.dp_rank = rank, dp_rank
        self.launch = 0
        self._file = (self.dir / f"rank-{rank:05d}.jsonl").open("a", encoding="utf-8") \
            if writes else None

    def count_launches(self) -> None:
        """Every rank reads the number of this launch before rank 0 appends it (a barrier must
        separate the two calls)."""
        path = self.dir / LAUNCHES
        self.launch = len(path.read_text().splitlines()) if path.exists() else 0

    def start_launch(self, start_step: int, world_size: int, dp: int, global_batch: int,
                     skipped: tuple[int, int] | None = None,
                     branch: dict | None = None) -> None:
        """Rank 0 records the launch; `skipped` declares samples [a, b) deliberately never
        trained on (a rollback past batches that made training diverge); `branch` marks a launch
        that continues from an older checkpoint than the run's newest (`run.branch`)."""
        if self.rank == 0:
            record = {"launch": self.launch, "start_step": start_step, "world_size": world_size,
                      "dp": dp, "global_batch": global_batch}
            if skipped is not None:
                record["skipped"] = list(skipped)
            if branch is not None:
                record["branch"] = branch
            with (self.dir / LAUNCHES).open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def record(self, step: int, micro_batches: list[np.ndarray]) -> None:
        if self._file is None:
            return
        indices = np.concatenate(micro_batches) if micro_batches else np.zeros(0, np.int64)
        self._file.write(json.dumps({"launch": self.launch, "step": step, "dp_rank": self.dp_rank,
                                     "ranges": to_ranges(indices)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
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
    """Check, for steps 1..last (each judged in the launch that owns it):
    - every data-parallel replica of that launch wrote the step, once;
    - the step used exactly `global_batch` samples, each exactly once across replicas, as one
      contiguous block that starts where the previous step ended — except over samples a
      rollback declared skipped, which no later step may use."""
    ledger = run_dir / LEDGER_DIR
    launches = [json.loads(line) for line in (ledger / LAUNCHES).read_text().splitlines()
                if line.strip()]
    by_launch = {entry["launch"]: entry for entry in launches}
    records: dict[tuple[int, int], list[tuple[int, list[list[int]]]]] = {}
    for path in sorted(ledger.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            records.setdefault((entry["launch"], entry["step"]), []).append(
                (entry.get("dp_rank", rank), entry["ranges"]))  # older ledgers: one per rank
    report = LedgerReport(launches=len(launches))
    last_launch = max(by_launch)
    last_step = max((s for (launch, s) in records if launch == last_launch), default=0)
    expected_start = 0
    for step in range(1, last_step + 1):
        owner = max(la for la, entry in by_launch.items() if entry["start_step"] < step)
        skips = [tuple(e["skipped"]) for la, e in by_launch.items() if la <= owner and "skipped" in e]
        entries = records.get((owner, step), [])
        if not entries:
            report.problems.append(f"step {step}: no rank recorded it in launch {owner}")
            continue
        report.problems.extend(_replica_problems(step, by_launch[owner], entries))
        seen: dict[int, int] = {}
        for replica, ranges in entries:
            for a, b in ranges:
                for i in range(a, b):
                    if i in seen:
                        report.problems.append(f"step {step}: sample {i} used twice (data-"
                                               f"parallel ranks {seen[i]} and {replica})")
                    seen[i] = replica
        used_skipped = sorted(i for i in seen if any(a <= i < b for a, b in skips))
        if used_skipped:
            report.problems.append(f"step {step}: samples {used_skipped[:5]} were declared "
                                   "skipped by a rollback but trained on")
        want = by_launch[owner].get("global_batch")
        if want is not None and len(seen) != want:
            report.problems.append(f"step {step}: {len(seen)} samples used, but the global batch "
                                   f"of launch {owner} is {want}")
        lo, hi = min(seen), max(seen) + 1
        expected_start, jumped = _past_skips(expected_start, skips)
        report.skipped += jumped
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


def _replica_problems(step: int, launch: dict, entries: list[tuple[int, list[list[int]]]]
                      ) -> list[str]:
    """Every data-parallel replica of the launch recorded the step exactly once."""
    dp = launch.get("dp")
    if dp is None:  # a ledger from before replicas were recorded
        return []
    replicas = [replica for replica, _ in entries]
    problems = []
    missing = sorted(set(range(dp)) - set(replicas))
    if missing:
        problems.append(f"step {step}: data-parallel ranks {missing} of {dp} wrote no record "
                        f"in launch {launch['launch']}")
    twice = sorted({r for r in replicas if replicas.count(r) > 1})
    if twice:
        problems.append(f"step {step}: data-parallel ranks {twice} recorded it more than once "
                        f"in launch {launch['launch']} (a replica's tp/pp peers must not write)")
    return problems


def _past_skips(start: int, skips: list[tuple[int, int]]) -> tuple[int, int]:
    """Where the next step must begin when `start` falls inside declared-skipped ranges, and
    how many samples that passes over."""
    jumped = 0
    moved = True
    while moved:
        moved = False
        for a, b in skips:
            if a <= start < b:
                jumped += b - start
                start, moved = b, True
    return start, jumped
