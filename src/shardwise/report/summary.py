"""The numbers at the top of a report: one row per quantity, one column per run.

Every value is read from the run's events; a value the run did not record shows as "—" rather than
a guess, so an older run's report never claims a measurement it does not have.
"""

from __future__ import annotations

import statistics
from typing import Any

from shardwise.telemetry.readback import Run, finite, num

MISSING = "—"


def summary_rows(runs: list[Run]) -> list[tuple[str, list[str]]]:
    """(label, one cell per run) for the summary table."""
    columns = [_summary(run) for run in runs]
    labels = list(columns[0])
    return [(label, [col[label] for col in columns]) for label in labels]


def _summary(run: Run) -> dict[str, str]:
    start, steps, evals = run.start, run.steps(), run.evals()
    ends = run.of("run_end")
    end = ends[-1] if ends else {}
    last_step = steps[-1] if steps else {}
    final_loss = _latest(last_step, "loss", end, "final_loss")
    val = num(evals[-1], "val_loss") if evals else num(end, "val_loss")
    unigram = num(end, "unigram_loss") or num(start, "unigram_loss")
    tokens = _latest(last_step, "tokens_seen", end, "tokens_seen")
    mfus = [v for e in steps if finite(v := num(e, "mfu"))]
    tps = [v for e in steps if finite(v := num(e, "tokens_per_s"))]
    checkpoints = run.of("checkpoint")
    saves = [v for e in checkpoints if (v := num(e, "save_seconds")) is not None]
    restarts = len(run.of("restart"))
    resumes = max(len(run.launches) - 1, 0)
    final_step = max((int(e["step"]) for e in run.events if isinstance(e.get("step"), int)),
                     default=0)
    return {
        "run": run.name,
        "layout": str(start.get("layout", MISSING)),
        "world size": _int(num(start, "world_size")),
        "device": str(start.get("device", MISSING)),
        "model parameters": _int(num(start, "model_params")),
        "final step": str(final_step),
        "final train loss": _f(final_loss, 4),
        "final held-out loss": _f(val, 4) + (f" (unigram {_f(unigram, 4)})" if finite(unigram)
                                               and finite(val) else ""),
        "tokens": _int(tokens),
        "wall time": _wall(run),
        "mean tokens/s": _int(statistics.mean(tps)) if tps else MISSING,
        "mean MFU": f"{100 * statistics.mean(mfus):.1f} %" if mfus else MISSING,
        "goodput": f"{100 * g:.1f} %" if finite(g := num(end, "goodput")) else MISSING,
        "launches": f"{len(run.launches)} ({resumes} resumed, {restarts} restart events)",
        "faults": _faults(run),
        "checkpoints": (f"{len(checkpoints)}, {sum(saves):.2f} s saving" if saves
                        else str(len(checkpoints))),
        "expert balance": _experts(last_step),
        "target loss": _target(run, end),
        "energy": _energy(run, tokens),
        "leakage audit": _audit(run),
    }


def _target(run: Run, end: dict[str, Any]) -> str:
    """When the run first reached `eval.target_loss` (recorded in run_end), in steps, tokens and
    training time."""
    target = num(end, "target_loss")
    if target is None:
        return MISSING
    from shardwise.compare.figures import Timeline, eval_points

    points = eval_points(run, Timeline(run))
    hit = next((p for p in points if p.loss <= target), None)
    if hit is None:
        best = min((p.loss for p in points), default=None)
        return f"{target:g} not reached" + (f" (best {best:.4f})" if best is not None else "")
    tokens = f"{hit.tokens:,.0f} tokens, " if hit.tokens is not None else ""
    return f"{target:g} at step {hit.step} ({tokens}{hit.seconds:.1f} s of training)"


def _energy(run: Run, tokens: float | None) -> str:
    """Measured energy (the step events' energy_j), or why there is none."""
    joules = [v for e in run.of("step") if finite(v := num(e, "energy_j"))]
    if joules:
        total = sum(joules)
        sources = sorted({str(e["energy_source"]) for e in run.of("step") if e.get("energy_source")})
        per_token = f", {1000 * total / tokens:.3f} mJ/token" if finite(tokens) and tokens else ""
        return f"{total / 1000:,.2f} kJ ({'+'.join(sources)}){per_token}"
    said = [e for e in run.of("energy") if e.get("note")]
    return f"not measurable here: {said[-1]['note']}" if said else MISSING


def _audit(run: Run) -> str:
    """The verdict of `shardwise audit` on this run (RUN_DIR/audit.json), if it was run."""
    import json

    path = run.run_dir / "audit.json"
    if not path.is_file():
        return f"not run (shardwise audit {run.run_dir})"
    try:
        result = json.loads(path.read_text())
        exact, near = len(result["exact"]), len(result["near"])
        held = result["held_out"]["sequences"]
    except (ValueError, KeyError, TypeError, OSError):
        return "audit.json unreadable: run `shardwise audit` again"
    found = f"{exact} exact, {near} near-duplicate{'s' if near != 1 else ''}"
    return (f"PASS: {found} among {held:,} held-out sequences" if result.get("passed")
            else f"FAIL: {found} among {held:,} held-out sequences")


def _experts(step_event: dict[str, Any]) -> str:
    """The last step's routing (mixture-of-experts runs): load imbalance and balance loss."""
    cv, aux = num(step_event, "moe_load_cv"), num(step_event, "moe_aux_loss")
    if not finite(cv):
        return MISSING
    dropped = num(step_event, "moe_dropped_fraction")
    return (f"load CV {cv:.3f}, balance loss {_f(aux, 3)}"
            + (f", {100 * dropped:.1f} % dropped" if finite(dropped) and dropped else ""))


def _latest(step_event: dict[str, Any], step_key: str, end: dict[str, Any], end_key: str
            ) -> float | None:
    """The value from whichever of the last step event and run_end is at the later step (run_end
    wins a tie: it is written after the last step, which log.every may not have logged)."""
    a, b = num(step_event, step_key), num(end, end_key)
    if b is None:
        return a
    if a is None or int(end.get("step") or 0) >= int(step_event.get("step") or 0):
        return b
    return a


def _wall(run: Run) -> str:
    """Time spent inside launches, each from its first to its last event: downtime between a crash
    and a resume is not training time, and is not counted."""
    spans = run.launch_spans()
    if not spans:
        return MISSING
    total = sum(hi - lo for lo, hi in spans)
    text = f"{total:.1f} s" if total < 600 else f"{total / 60:.1f} min"
    return text + (f" over {len(spans)} launches" if len(spans) > 1 else "")


def _faults(run: Run) -> str:
    counts = {kind: len(run.of(kind)) for kind in
              ("straggler", "hang", "nonfinite", "rollback", "checkpoint_rejected")}
    found = [f"{n} {kind.replace('_', ' ')}" for kind, n in counts.items() if n]
    return ", ".join(found) if found else "none"


def _f(value: float | None, digits: int) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def _int(value: float | None) -> str:
    return MISSING if not finite(value) else f"{round(value):,}"
