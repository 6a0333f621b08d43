"""`shardwise verify`'s comparison with the layouts trained in the pooled test ranks.

The CLI launches fresh workers per world size for every call (about 8 s at world 2 and 12 s at
world 4 on a 2-core machine, before the first step), so a test that checks a model across a dozen
layouts through the CLI spends most of its time starting Python. This runs the same product code
on the same layouts — `verify.runner.layout_spec` for each layout's spec, `preflight_all` before
any trains, `run_worker` with `dump_final_state` in every rank, `read_outcome` and `compare` on
what the runs wrote (per-step losses, the whole parameter vector, the optimizer state when bitwise,
the sample ledger) — with only the launcher swapped for the pool. The CLI's own path (argument
checks, the elastic launch, one launch per world size, the table) keeps its tests in
tests/e2e/test_verify.py and one CLI row per model family.
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.run import rundir
from shardwise.spec import load_spec
from shardwise.verify.layouts import parse_layout
from shardwise.verify.runner import (
    Comparison,
    compare,
    format_table,
    layout_spec,
    preflight_all,
    read_outcome,
)
from tests.support.ranks import run_ranks
from tests.support.workers import train_and_dump


def verify_pooled(config: Path, layouts: str, out: Path, *overrides: str, steps: int = 3,
                  restart_at: int = 0, resume_layout: str = "",
                  rtol: float = 1e-5) -> list[Comparison]:
    """Every layout after the first against the first, as `shardwise verify CONFIG --layouts
    LAYOUTS --steps STEPS --set OVERRIDES [--restart-at K --resume-layout L]` compares them (the
    stop-and-resume pair last, as the CLI plans it); asserts that every row passed (the table is
    the assertion's message) and returns the rows."""
    invariant = load_spec(str(config), list(overrides)).run.determinism == "invariant"
    parsed = [parse_layout(name) for name in layouts.split(",")]
    runs = [(layout.name, layout_spec(str(config), list(overrides), layout, out / layout.name,
                                      steps), False) for layout in parsed]
    if restart_at:
        second = parse_layout(resume_layout) if resume_layout else parsed[0]
        name = f"{parsed[0].name}@{restart_at}->{second.name}"
        run_dir = out / name.replace(">", "").replace("@", "-stop")
        runs += [(f"{name} (stop)", layout_spec(str(config), list(overrides), parsed[0], run_dir,
                                                steps, stop_at=restart_at), False),
                 (name, layout_spec(str(config), list(overrides), second, run_dir, steps), True)]
    checked = preflight_all({name: spec for name, spec, _ in runs})
    outcomes = []
    for name, _, resume in runs:
        spec = checked[name]
        run_dir = Path(spec.run.dir)
        if not resume:
            rundir.new_run_dir(spec)
        rundir.write_spec(run_dir, spec)
        if spec.parallel.nproc == 1:
            _in_this_process(spec, resume)
        else:
            run_ranks(train_and_dump, spec.parallel.nproc, spec, resume, timeout=240)
        if not name.endswith("(stop)"):
            outcomes.append(read_outcome(name, run_dir, 0.0))
    rows = [compare(outcomes[0], o, rtol, invariant) for o in outcomes[1:]]
    table = format_table(rows, parsed[0].name)
    assert outcomes[0].ledger_exact and all(r.passed for r in rows), table
    return rows


def _in_this_process(spec, resume: bool) -> None:
    """The world-1 reference in the test process, restoring what a determinism mode changes."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        train_and_dump(None, spec, resume)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
