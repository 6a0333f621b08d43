"""The one rule that decides whether a launch starts fresh or continues from a checkpoint, and
what a resumed spec may change.

Every way a run starts — `shardwise train`, `train --resume`, the elastic agent restarting the
workers, torchrun (with or without `--max-restarts`), a Slurm requeue, `shardwise launch` — asks
`resume_mode` and hands the answer to `Trainer.start`, which alone acts on it:

- a fresh launch (no `--resume`, attempt 0): a fresh run;
- a continued one (`--resume RUN_DIR`, which the Slurm script and `shardwise launch` also use once
  RUN_DIR exists, or a restart: attempt > 0): continue from the newest valid checkpoint; a run
  that died before its first checkpoint trains again from step 0 in the same run directory
  (the ledger and metrics record the new launch). Only checkpoints that exist and all fail to
  verify are an error: something would be lost.

A resumed spec may change how the run is laid out (layout, precision, batch split, telemetry,
its length) but not what the checkpoint's numbers mean: `check_compatible` refuses a different
model, data or seed, naming the field. A run already at its last step is complete: continuing it
changes nothing and exits 0, unless the resume asked for a length it has already reached.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any

from shardwise.errors import UserError
from shardwise.resilience.attempt import launch_attempt
from shardwise.spec.runspec import OptimizerSection, RunSpec


class ResumeMode(Enum):
    FRESH = "fresh"
    CONTINUE = "continue"  # the newest valid checkpoint if there is one, else step 0


def restart_attempt() -> int:
    """0 for the first start, N after the launcher restarted the workers N times (agreed by
    every node: see shardwise.resilience.attempt)."""
    return launch_attempt()


def resume_mode(requested: bool, attempt: int | None = None) -> ResumeMode:
    attempt = restart_attempt() if attempt is None else attempt
    return ResumeMode.CONTINUE if requested or attempt > 0 else ResumeMode.FRESH


# --- what a resume may change -------------------------------------------------------------------
#: (section, key) of fields that define what a checkpoint's numbers mean; None: the whole section
#: ([model] but how it is built: `init`). Everything else may change at a resume.
BINDING: tuple[tuple[str, str | None], ...] = (
    ("model", None),
    ("data", "source"), ("data", "args"), ("data", "content_hash"), ("data", "tokenizer_hash"),
    ("data", "tokenizer"), ("data", "seq_len"), ("data", "vocab_size"), ("data", "val_fraction"),
    ("data", "text_field"), ("data", "split"),
    ("run", "seed"),
)
_FREE_IN_BINDING = {("model", "init")}  # how a model is built changes no number


def differences(saved: Mapping[str, Any], spec: RunSpec) -> Iterator[tuple[str, Any, Any]]:
    """`section.key`, the checkpoint's value and the resumed spec's, for every binding field that
    differs. A field the saved spec lacks (an older shardwise) or that it left empty where the
    run fills it in (data hashes pinned at launch) is not a difference."""
    now = spec.to_dict()
    for section, key in BINDING:
        old, new = saved.get(section, {}), now.get(section, {})
        keys = [key] if key is not None else sorted(set(old) | set(new))
        for k in keys:
            if (section, k) in _FREE_IN_BINDING or k not in old:
                continue
            if old.get(k) in ("", None) and k.endswith("_hash"):
                continue
            if old.get(k) != new.get(k):
                yield f"{section}.{k}", old.get(k), new.get(k)


def check_compatible(saved: Mapping[str, Any], spec: RunSpec, checkpoint: str) -> None:
    """Refuse to resume `checkpoint` (whose manifest holds the `saved` spec) with a spec whose
    model, data or seed differ: the weights, optimizer state and data position would not mean
    what they meant."""
    found = list(differences(saved, spec))
    if not found:
        return
    field, old, new = found[0]
    more = f" (and {', '.join(f for f, _, _ in found[1:4])})" if len(found) > 1 else ""
    raise UserError(
        f"cannot resume {checkpoint}: it was trained with {field} = {_shown(old)}, and the spec "
        f"now says {_shown(new)}{more}. A checkpoint continues only the model, data and seed it "
        f"was trained with. Drop the --set that changes {field}; to train something else from "
        "scratch, start a new run (`shardwise train CONFIG`, a new run directory).")


def lr_change_note(saved: Mapping[str, Any], spec: RunSpec, step: int) -> str | None:
    """A warning when the resumed spec moves the learning rate at `step` (a longer `run.steps`
    stretches the cosine schedule; a new lr or schedule changes it), with the numbers."""
    from shardwise.run.schedule import lr_at
    from shardwise.spec.toml import build_table

    try:
        old_opt = build_table("optimizer", OptimizerSection, saved.get("optimizer", {}), "")
        old_steps = int(saved.get("run", {}).get("steps", spec.run.steps))
    except Exception:  # a saved spec of another version: nothing to compare
        return None
    before, after = lr_at(step, old_opt, old_steps), lr_at(step, spec.optimizer, spec.run.steps)
    if abs(after - before) <= 1e-3 * max(abs(before), 1e-12):
        return None
    why = (f"run.steps {old_steps} -> {spec.run.steps} stretches the schedule"
           if old_steps != spec.run.steps else "the [optimizer] section changed")
    return (f"warning: the learning rate at step {step} moves from {before:.3g} to {after:.3g} "
            f"({after / before if before else float('inf'):.2g}x): {why}. To go on at the rate "
            f"the run had, resume with --set optimizer.schedule=\"constant\" --set "
            f"optimizer.lr={before:.6g} --set optimizer.warmup_steps=0.")


def complete(step: int, spec: RunSpec, saved: Mapping[str, Any], where: str) -> bool:
    """True when the run is already at its last step and the resume asked for nothing more
    (continuing it is a no-op: a requeue after the final save, a restart after the end); a
    UserError when the resume changed the length to one the run has already reached."""
    target = spec.run.stop_at or spec.run.steps
    if step < target:
        return False
    run = saved.get("run", {})
    asked_more = (int(run.get("steps", spec.run.steps)), int(run.get("stop_at", spec.run.stop_at))) \
        != (spec.run.steps, spec.run.stop_at)
    if not asked_more:
        return True
    how = (f"--set run.stop_at=0 to run on to run.steps = {spec.run.steps} (or stop_at=N "
           f"for some N > {step})") if spec.run.stop_at and spec.run.steps > step else \
        f"--set run.steps=N for some N > {step}"
    raise UserError(
        f"{where} is already at step {step}, and the resume asks to stop at step {target} "
        f"(run.steps = {spec.run.steps}, run.stop_at = {spec.run.stop_at}). To train further, "
        f"resume with {how}.")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
