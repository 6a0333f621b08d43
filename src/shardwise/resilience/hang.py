"""Hang and collective-mismatch diagnosis: every rank's flight record in, a report naming ranks out.

Run by the watchdog of a rank that stopped making progress, and by the launcher after workers
died (gloo aborts a process on a size mismatch, so the dead rank cannot report itself). The
reasoning is the same either way: ranks of a group must issue the same collectives in the same
order, so per group the n-th call must match on every rank. The report names
- ranks that issued a *different* n-th call (op or size) than the others — a mismatch;
- ranks that never issued the n-th call the others are waiting in — they diverged (a hang,
  a rank stuck in compute, or a rank that skipped a collective);
- and, for each rank, where it was: step, phase, last call, seconds since its last progress.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shardwise.resilience.flight import Call, RankFlight, read_all
from shardwise.utils.files import atomic_write_text

REPORT = "hang-report.txt"


@dataclass
class Diagnosis:
    findings: list[str] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # the ranks named as diverged
    per_rank: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return bool(self.ranks)

    def text(self, headline: str) -> str:
        lines = [headline]
        if self.ranks:
            lines.append(f"Diverged: rank{'s' if len(self.ranks) > 1 else ''} "
                         f"{', '.join(map(str, self.ranks))}.")
        lines += [f"- {f}" for f in self.findings]
        lines.append("Where each rank was:")
        lines += [f"  {line}" for line in self.per_rank]
        return "\n".join(lines)


def diagnose(flights: list[RankFlight], world: int, now: float | None = None) -> Diagnosis:
    now = now if now is not None else time.time()
    out = Diagnosis()
    named: set[int] = set()
    present = {f.rank for f in flights}
    for rank in range(world):
        if rank not in present:
            out.findings.append(f"rank {rank} left no flight record (it never started, or its "
                                "file was removed).")
            named.add(rank)
    groups = sorted({c.group for f in flights for c in f.calls})
    for group in groups:
        calls = {f.rank: [c for c in f.calls if c.group == group] for f in flights}
        calls = {r: cs for r, cs in calls.items() if cs}
        if len(calls) < 2:
            continue
        _mismatches(group, calls, out, named)
        _stragglers_in_group(group, calls, out, named, now)
    for f in flights:
        last = f.calls[-1].describe() if f.calls else "no collective yet"
        out.per_rank.append(f"rank {f.rank}: step {f.step}, phase {f.phase}, last progress "
                            f"{max(0.0, now - f.t_progress):.1f} s ago; last collective: {last}")
    out.ranks = sorted(named)
    return out


def _mismatches(group: str, calls: dict[int, list[Call]], out: Diagnosis, named: set[int]) -> None:
    """The first sequence number, held by every rank, whose call differs between ranks."""
    by_seq = {r: {c.gseq: c for c in cs} for r, cs in calls.items()}
    common = set.intersection(*(set(s) for s in by_seq.values()))
    for gseq in sorted(common):
        kinds = {r: (s[gseq].op, s[gseq].bytes) for r, s in by_seq.items()}
        if len(set(kinds.values())) == 1:
            continue
        counts = Counter(kinds.values())
        top = counts.most_common()
        lowest = min(kinds)
        # The majority call is the expected one; on a tie, the lowest rank's.
        expected = top[0][0] if len(top) == 1 or top[0][1] > top[1][1] else kinds[lowest]
        odd = sorted(r for r, k in kinds.items() if k != expected)
        detail = "; ".join(f"rank {r}: {by_seq[r][gseq].op} of {_fmt(by_seq[r][gseq].bytes)}"
                           for r in sorted(kinds))
        out.findings.append(f"collective mismatch: call #{gseq} on {group} differs between "
                            f"ranks ({detail}). Every rank of a group must issue the same "
                            "collectives, with the same sizes, in the same order.")
        named.update(odd)
        return


def _stragglers_in_group(group: str, calls: dict[int, list[Call]], out: Diagnosis,
                         named: set[int], now: float) -> None:
    """Ranks waiting in call #n while others never issued it."""
    last = {r: cs[-1] for r, cs in calls.items()}
    waiting = {r: c for r, c in last.items() if not c.done}
    if not waiting:
        return
    front = max(c.gseq for c in waiting.values())
    behind = sorted(r for r, c in last.items() if c.gseq < front)
    if not behind:
        return
    waiter = next(c for c in waiting.values() if c.gseq == front)
    waiters = sorted(r for r, c in waiting.items() if c.gseq == front)
    out.findings.append(
        f"rank{'s' if len(waiters) > 1 else ''} {', '.join(map(str, waiters))} "
        f"{'have' if len(waiters) > 1 else 'has'} been waiting {now - waiter.t_issue:.1f} s in "
        f"{waiter.op} #{front} on {group} ({_fmt(waiter.bytes)}, step {waiter.step}), which "
        f"rank{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} never issued "
        f"(last: #{', #'.join(str(last[r].gseq) for r in behind)}).")
    # With two ranks both sides wait on each other: name the side that is behind.
    named.update(behind)


def _fmt(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KB" if nbytes < 1 << 20 \
        else f"{nbytes / (1 << 20):.1f} MB"


def report(directory: Path, world: int, headline: str) -> Diagnosis:
    """Diagnose the flights in `directory`, write `hang-report.txt` there, return the diagnosis."""
    flights = read_all(directory)
    diagnosis = diagnose(flights, world)
    save(directory, diagnosis, diagnosis.text(headline),
         max((f.step for f in flights), default=0))
    return diagnosis


def dump_collectives(directory: Path) -> None:
    """Every rank's recorded collectives, decoded, as `collectives-rank-K.json`."""
    flights = read_all(directory)
    for flight in flights:
        atomic_write_text(directory / f"collectives-rank-{flight.rank}.json", json.dumps({
            "rank": flight.rank, "step": flight.step, "phase": flight.phase,
            "last_progress": flight.t_progress,
            "collectives": [dataclasses.asdict(c) for c in flight.calls]}, indent=1))


def save(directory: Path, diagnosis: Diagnosis, text: str, step: int) -> None:
    """The report as text for people and as JSON for the launcher's `hang` event; every rank's
    decoded collectives next to it."""
    dump_collectives(directory)
    atomic_write_text(directory / REPORT.replace(".txt", ".json"),
                      json.dumps({"ranks": diagnosis.ranks, "step": step, "report": text}))
    atomic_write_text(directory / REPORT, text + "\n")


def append_event(run_dir: Path, directory: Path, source: str) -> None:
    """Add the report of `directory` to metrics.jsonl as a `hang` event, unless a rank did."""
    summary_path = directory / REPORT.replace(".txt", ".json")
    metrics = run_dir / "metrics.jsonl"
    if not summary_path.exists():
        return
    attempt = int(directory.name.split("-")[1])
    if metrics.exists():
        for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines():
            if '"hang"' in line and f'"attempt": {attempt}' in line:
                return
    summary = json.loads(summary_path.read_text())
    event = {"kind": "hang", "run_id": run_dir.name, "rank": -1, "step": summary["step"],
             "time": round(time.time(), 3), "ranks": summary["ranks"],
             "report": summary["report"], "attempt": attempt, "source": source}
    with metrics.open("a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")


def latest_attempt_dir(run_dir: Path) -> Path | None:
    root = run_dir / "diagnostics"
    attempts = sorted(root.glob("attempt-*"), key=lambda p: int(p.name.split("-")[1])) \
        if root.exists() else []
    return attempts[-1] if attempts else None
