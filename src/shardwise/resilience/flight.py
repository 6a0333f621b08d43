"""A flight recorder per rank: its last collectives and what it is doing, in a memory-mapped file.

Why a file: the classic failures are a rank that hangs (its peers wait forever in a collective) and
a collective mismatch, which gloo answers by aborting the process from a C++ thread — no Python
handler runs. Records written into a shared mapping are in the page cache the moment they are
written, so they outlive the process: the watchdog of a live rank, or the launcher after the
workers died, reads every rank's file and says who diverged (`shardwise.resilience.hang`).

Layout: a header (rank, world, step, phase, last progress time, record count) and a ring of
fixed-size records (sequence number overall and per group, op, group, bytes, step, issue and
completion times). Group and op names are small integers; their names are in a JSON side file.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"SWFR0001"
HEADER = struct.Struct("<8siiqiiddq")  # magic rank world pid step phase t_progress t_start count
RECORD = struct.Struct("<qqiiqiidd")  # seq gseq group op bytes step state t_issue t_done
_STATE_AT, _DONE_AT = 36, 48  # byte offsets of `state` and `t_done` in a record
_PROGRESS_AT, _COUNT_AT = 32, 48  # byte offsets of `t_progress` and `count` in the header
_SEQ, _STATE, _TIME = struct.Struct("<q"), struct.Struct("<i"), struct.Struct("<d")
CAPACITY = 256
PHASES = ("idle", "data", "forward", "backward", "optimizer", "checkpoint-write", "checkpoint",
          "eval", "hook")
ISSUED, DONE = 1, 2


def flight_dir(run_dir: Path, attempt: int) -> Path:
    return run_dir / "diagnostics" / f"attempt-{attempt}"


class FlightRecorder:
    """Writer side: one per rank. Thread-safe enough for its use (the GIL; completion callbacks
    from the backend's threads only overwrite their own record's state)."""

    def __init__(self, directory: Path, rank: int, world: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank}.bin"
        self.names_path = directory / f"rank-{rank}.json"
        size = HEADER.size + CAPACITY * RECORD.size
        with open(self.path, "wb") as f:
            f.truncate(size)
        self._file = open(self.path, "r+b")  # noqa: SIM115 - the mapping lives as long as we do
        self._map = mmap.mmap(self._file.fileno(), size)
        self.rank, self.world = rank, world
        self.count = 0
        self._gseq: dict[int, int] = {}
        self._groups: dict[str, int] = {}
        self._ops: dict[str, int] = {}
        self.step, self.phase = 0, 0
        self.t_start = time.time()
        self._header(time.time())

    def _header(self, now: float) -> None:
        HEADER.pack_into(self._map, 0, MAGIC, self.rank, self.world, os.getpid(), self.step,
                         self.phase, now, self.t_start, self.count)

    def _index(self, table: dict[str, int], name: str) -> int:
        index = table.get(name)
        if index is None:
            index = table[name] = len(table)
            self._write_names()
        return index

    def _write_names(self) -> None:
        tmp = self.names_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"groups": list(self._groups), "ops": list(self._ops)}))
            os.replace(tmp, self.names_path)
        except OSError:  # diagnostics are best effort: never stop training over them
            pass

    # --- what the rank does ------------------------------------------------------------------
    def progress(self, step: int, phase: str) -> None:
        """The rank entered `phase` of `step` (also a heartbeat for the watchdog)."""
        self.step = step
        self.phase = PHASES.index(phase) if phase in PHASES else PHASES.index("hook")
        self._header(time.time())

    def issue(self, op: str, group: str, nbytes: int, step: int) -> int:
        group_index = self._index(self._groups, group)
        gseq = self._gseq.get(group_index, 0) + 1
        self._gseq[group_index] = gseq
        slot = self.count % CAPACITY
        seq = self.count
        self.count += 1
        now = time.time()
        RECORD.pack_into(self._map, HEADER.size + slot * RECORD.size, seq, gseq, group_index,
                         self._index(self._ops, op), nbytes, step, ISSUED, now, 0.0)
        _TIME.pack_into(self._map, _PROGRESS_AT, now)  # the hot path writes two header fields,
        _SEQ.pack_into(self._map, _COUNT_AT, self.count)  # not the whole header
        return seq

    def complete(self, seq: int) -> None:
        offset = HEADER.size + (seq % CAPACITY) * RECORD.size
        if _SEQ.unpack_from(self._map, offset)[0] != seq:
            return  # overwritten by newer records: nothing to mark
        now = time.time()
        _STATE.pack_into(self._map, offset + _STATE_AT, DONE)
        _TIME.pack_into(self._map, offset + _DONE_AT, now)
        _TIME.pack_into(self._map, _PROGRESS_AT, now)

    def last_progress(self) -> float:
        return HEADER.unpack_from(self._map, 0)[6]

    def close(self) -> None:
        self._map.flush()
        self._map.close()
        self._file.close()


@dataclass(frozen=True)
class Call:
    seq: int
    gseq: int
    group: str
    op: str
    bytes: int
    step: int
    done: bool
    t_issue: float
    t_done: float

    def describe(self) -> str:
        state = "completed" if self.done else "still waiting"
        return (f"{self.op} #{self.gseq} on {self.group} ({_size(self.bytes)}, step {self.step}, "
                f"{state})")


@dataclass(frozen=True)
class RankFlight:
    """Reader side: what one rank's file says."""

    rank: int
    world: int
    pid: int
    step: int
    phase: str
    t_progress: float
    calls: list[Call]

    def last_by_group(self) -> dict[str, Call]:
        out: dict[str, Call] = {}
        for call in self.calls:
            out[call.group] = call
        return out


def read_flight(path: Path) -> RankFlight | None:
    """Parse one rank's file; None if it is missing or not a flight file."""
    try:
        data = path.read_bytes()
        names = json.loads(path.with_suffix(".json").read_text()) \
            if path.with_suffix(".json").exists() else {"groups": [], "ops": []}
    except (OSError, ValueError):
        return None
    if len(data) < HEADER.size or data[:8] != MAGIC:
        return None
    _, rank, world, pid, step, phase, t_progress, _, count = HEADER.unpack_from(data, 0)
    calls = []
    for seq in range(max(0, count - CAPACITY), count):
        rec = RECORD.unpack_from(data, HEADER.size + (seq % CAPACITY) * RECORD.size)
        if rec[0] != seq or rec[6] not in (ISSUED, DONE):
            continue
        group = _name(names["groups"], rec[2])
        calls.append(Call(seq, rec[1], group, _name(names["ops"], rec[3]), rec[4], rec[5],
                          rec[6] == DONE, rec[7], rec[8]))
    return RankFlight(rank, world, pid, step, PHASES[phase] if 0 <= phase < len(PHASES) else "?",
                      t_progress, calls)


def _name(table: list[str], index: int) -> str:
    return table[index] if 0 <= index < len(table) else f"#{index}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def read_all(directory: Path) -> list[RankFlight]:
    """Every rank's flight in `directory`, in rank order."""
    flights = [f for f in (read_flight(p) for p in sorted(directory.glob("rank-*.bin")))
               if f is not None]
    return sorted(flights, key=lambda f: f.rank)
