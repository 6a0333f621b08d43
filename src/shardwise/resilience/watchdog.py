"""The hang watchdog: a thread per rank that notices when the rank stops making progress.

Progress is any phase change (data, forward, backward, optimizer, hooks) or collective issued or
completed, as written in the flight recorder's header. On a GPU a collective's completion is seen
only by polling its device events (the comm tap's `poll`); the watchdog polls too, each round and
without blocking, so a rank whose training thread waits on the device while its collectives keep
completing is making progress, not hanging. When none happens for
`failure.hang_timeout_s`, the watchdog writes this rank's Python stacks, waits a moment for the
other ranks' watchdogs to do the same, diagnoses every rank's flight record, writes
`RUN_DIR/diagnostics/attempt-N/hang-report.txt` (one rank prints it) and ends the process with
`HANG_EXIT`, so the job fails in bounded time instead of waiting for the backend's timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from shardwise.resilience.flight import FlightRecorder, read_all
from shardwise.resilience.hang import REPORT, Diagnosis, diagnose, report

HANG_EXIT = 3


class Watchdog:
    def __init__(self, recorder: FlightRecorder, timeout_s: float, world: int,
                 on_fire: Callable[[Diagnosis, str], None] | None = None,
                 exit: Callable[[int], None] = os._exit,
                 poll: Callable[[], object] | None = None) -> None:
        self.recorder, self.timeout_s, self.world = recorder, timeout_s, world
        self.directory: Path = recorder.path.parent
        self.on_fire = on_fire
        self.poll = poll  # marks device-side completions in the recorder; never blocks
        self._exit = exit
        self._stop = threading.Event()
        self._paused = 0
        self._thread = threading.Thread(target=self._run, name="shardwise-watchdog", daemon=True)
        self.fired = False

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Work that may legitimately run long without a collective (writing a checkpoint)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.recorder.progress(self.recorder.step, "hook")

    def _run(self) -> None:
        poll = min(0.25, self.timeout_s / 4)
        while not self._stop.wait(poll):
            if self._paused:
                continue
            if self.poll is not None:
                with contextlib.suppress(Exception):  # telemetry must not stop the watchdog
                    self.poll()
            idle = time.time() - self.recorder.last_progress()
            if idle > self.timeout_s:
                self.fire(idle)
                return

    def fire(self, idle: float) -> None:
        self.fired = True
        rank = self.recorder.rank
        stacks = _stacks()
        (self.directory / f"stacks-rank-{rank}.txt").write_text(stacks)
        # Give the other ranks' watchdogs (same timeout, similar idle start) time to dump theirs.
        time.sleep(min(3.0, self.timeout_s))
        headline = (f"HANG: rank {rank} made no progress for {idle:.1f} s "
                    f"(failure.hang_timeout_s = {self.timeout_s:g}).")
        writer = _claim(self.directory / f".{REPORT}.lock")
        if writer:  # one rank writes the report; every rank diagnoses the same records
            diagnosis = report(self.directory, self.world, headline)
        else:
            diagnosis = diagnose(read_all(self.directory), self.world)
        text = diagnosis.text(headline)
        if writer:
            print(f"\n{text}Stacks of every rank: {self.directory}/stacks-rank-*.txt\n",
                  file=sys.stderr, flush=True)
        if self.on_fire is not None:
            with contextlib.suppress(Exception):
                self.on_fire(diagnosis, text)
        self._exit(HANG_EXIT)


def _claim(lock: Path) -> bool:
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask decides
        return True
    except FileExistsError:
        return False


def _stacks() -> str:
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in frames.items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n"
                     + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
