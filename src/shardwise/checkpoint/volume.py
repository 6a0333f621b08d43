"""A checkpoint volume that fills up: said in words, before or during a save, with nothing lost.

`torch.save` into a full volume fails with "enforce fail at inline_container.cc … unexpected
pos" rather than ENOSPC, and DCP wraps each rank's failure in a CheckpointException; a user
needs neither, but "the checkpoint volume is full (N MB free, a checkpoint needs M MB); the
newest valid checkpoint is step K". Before a save the free space of a local volume is compared
with the size of the last checkpoint; a write that fails anyway is recognised by its cause and
re-worded. The interrupted save is never loaded (no meta.json), and it is removed at once to give
its space back.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import META, step_of
from shardwise.checkpoint.location import Location

MARGIN = 1.05  # a checkpoint's size varies a little (metadata, RNG files)
_SIGNS = ("No space left", "unexpected pos", "file write failed", "Disk quota exceeded")


def free_bytes(root: Location) -> int | None:
    """Free bytes of the volume holding `root` (None on object storage: no such limit)."""
    if not isinstance(root, Path):
        return None
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def checkpoint_bytes(location: Location) -> int:
    """The size a committed checkpoint's meta.json records."""
    import json

    try:
        files = json.loads((location / META).read_text()).get("files", {})
        return sum(int(f.get("size", 0)) for f in files.values())
    except (OSError, ValueError, AttributeError):
        return 0


def is_out_of_space(err: BaseException) -> bool:
    """Whether `err`, or anything it wraps (its causes, DCP's per-rank failures), is a write that
    ran out of room."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(sign in str(e) for sign in _SIGNS):
            return True
    return False


def full_message(root: Location, step: int, needed: int, newest: str | None,
                 free: int | None = None) -> str:
    free = free_bytes(root) if free is None else free
    have = f"{free / 2**20:.0f} MB free" if free is not None else "it is full"
    need = f"a checkpoint needs {needed / 2**20:.0f} MB" if needed else \
        "the checkpoint did not fit"
    return (f"the checkpoint volume is full ({have} at {root}; {need}): step {step} was not "
            f"saved, and nothing else was lost. The newest valid checkpoint is "
            f"{newest or 'none yet: the run would start again from step 0'}. Free space there "
            "(or point checkpoint.uri at a larger volume, or keep fewer with "
            "checkpoint.keep_last), then continue with `shardwise train --resume RUN_DIR`.")


def newest_committed(step_dirs: list[Location]) -> Location | None:
    committed = [(s, p) for p in step_dirs if (s := step_of(p)) is not None and (p / META).exists()]
    return max(committed, key=lambda pair: pair[0])[1] if committed else None


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank ->
        if isinstance(failures, dict):  # (exception, its stack)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
