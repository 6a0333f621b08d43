"""The hash chain over a run's checkpoints: lineage that cannot be rewritten quietly.

Every meta.json carries `chain = {"prev_step": P, "prev_meta_sha256": D}`: the step and the
SHA-256 of the meta.json of the checkpoint this one descends from — the previous save of this
launch, or the checkpoint the launch resumed, rolled back or branched from (`null`s for a run's
first checkpoint). meta.json itself holds the size and SHA-256 of every file of its checkpoint
(the manifest included), so one link vouches for the whole previous checkpoint, and changing any
byte of an older checkpoint means rewriting every meta.json after it.

`verify` walks back from the newest checkpoint and names the first link that does not hold. What
it cannot do: vouch for the newest meta.json (nothing after it records its digest; the registry
does for a registered checkpoint, and `inspect --verify-chain` prints it so you can keep it), or
check across a checkpoint that retention deleted (reported as a gap, not a break). Checkpoints
written before the chain existed have no `chain`: the walk stops there ("no chain before step N").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from shardwise.checkpoint.integrity import verify as verify_files
from shardwise.checkpoint.layout import META, newest_first, step_dir_name, step_of
from shardwise.checkpoint.location import Location

KEY = "chain"


def digest(meta_text: str) -> str:
    """What the next checkpoint records of this one: the SHA-256 of its meta.json's bytes."""
    return hashlib.sha256(meta_text.encode()).hexdigest()


@dataclass(frozen=True)
class Head:
    """The checkpoint a next save descends from: its step, meta.json digest and own link (a
    re-save of the same step takes the link of the checkpoint it replaces)."""

    step: int
    meta_sha256: str
    link: dict[str, Any] | None

    @classmethod
    def of(cls, meta_text: str) -> Head:
        meta = json.loads(meta_text)
        return cls(int(meta["step"]), digest(meta_text), meta.get(KEY))


def next_link(head: Head | None, step: int) -> dict[str, Any]:
    """The `chain` field of a checkpoint of `step` saved after `head`."""
    if head is None:
        return {"prev_step": None, "prev_meta_sha256": None}
    if head.step == step:  # the same step saved again: it replaces `head`, with its parent
        return dict(head.link) if head.link else {"prev_step": None, "prev_meta_sha256": None}
    return {"prev_step": head.step, "prev_meta_sha256": head.meta_sha256}


@dataclass
class ChainReport:
    """What `verify` found, newest first: one line per checkpoint walked, the first broken link
    (None when the chain holds) and where the walk had to stop."""

    lines: list[str] = field(default_factory=list)
    broken: str | None = None
    stop: str = ""
    head_sha256: str | None = None
    links: int = 0

    @property
    def ok(self) -> bool:
        return self.broken is None


def verify(root: Location, step_dirs: list[Location], hash_files: bool = True) -> ChainReport:
    """Walk the chain back from the newest committed checkpoint in `step_dirs` (each checkpoint's
    files checked against its meta.json too when `hash_files`)."""
    report = ChainReport()
    committed = [p for p in newest_first(step_dirs) if (p / META).exists()]
    if not committed:
        report.stop = f"no committed checkpoint in {root}"
        return report
    by_step = {step_of(p): p for p in committed}
    current: Location | None = committed[0]
    while current is not None:
        text = (current / META).read_text()
        meta = json.loads(text)
        if report.head_sha256 is None:
            report.head_sha256 = digest(text)
        if hash_files:
            verdict = verify_files(current, 0, 1, False)
            if not verdict.valid:
                report.broken = (f"{current.name}: its files do not match its meta.json "
                                 f"({'; '.join(verdict.problems[:3])})")
                return report
        link = meta.get(KEY)
        if link is None:
            report.stop = f"no chain before step {meta.get('step')} (written before checkpoints " \
                          "carried one)"
            report.lines.append(f"{current.name}  meta {digest(text)[:16]}  (no chain field)")
            return report
        prev_step, want = link.get("prev_step"), link.get("prev_meta_sha256")
        if prev_step is None:
            report.lines.append(f"{current.name}  meta {digest(text)[:16]}  first checkpoint")
            report.stop = f"the chain starts at {current.name}"
            return report
        if int(prev_step) >= int(meta.get("step", 0)):
            report.broken = (f"{current.name}: its chain names step {prev_step} as its "
                             "predecessor, which is not earlier: its meta.json was edited")
            return report
        previous = by_step.get(int(prev_step))
        if previous is None:
            report.lines.append(f"{current.name}  meta {digest(text)[:16]}  links to "
                                f"{step_dir_name(int(prev_step))}, which is gone")
            report.stop = (f"{step_dir_name(int(prev_step))} is not there (deleted by retention "
                           f"or by hand): the chain cannot be checked before {current.name}")
            return report
        found = digest((previous / META).read_text())
        if found != want:
            report.broken = (f"{previous.name}: its meta.json hashes to {found[:16]}…, but "
                             f"{current.name} recorded {str(want)[:16]}… when it was saved: "
                             f"{previous.name} was rewritten (or replaced) after {current.name} "
                             "descended from it")
            return report
        report.lines.append(f"{current.name}  meta {digest(text)[:16]}  links to "
                            f"{previous.name}: ok")
        report.links += 1
        current = previous
    return report
