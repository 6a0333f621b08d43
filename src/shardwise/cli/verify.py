"""`shardwise verify`: compare layouts against a reference, restart mid-run, audit the ledger.

    shardwise verify CONFIG --layouts "dp1,zero3-2,zero3-4,hsdp-2x2" --steps 5
    shardwise verify CONFIG --layouts "dp1,zero3-4" --restart-at 3 --resume-layout zero3-2
    shardwise verify --ledger RUN_DIR
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="compare layouts against a reference, restart mid-run, audit the ledger",
        description="Run the job CONFIG describes under each layout and compare every one with "
                    "the first: per-step loss, final parameters and optimizer state, sample "
                    "ledger. Exit 0 only when every layout is within tolerance (bitwise when "
                    "run.determinism = \"invariant\"). With --ledger, audit one run's ledger.")
    p.add_argument("config", nargs="?", help="RunSpec TOML (default: the built-in defaults)")
    p.add_argument("--layouts", default="dp1,zero3-2",
                   help="comma-separated layouts, the first is the reference (default: dp1,zero3-2)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default 5)")
    p.add_argument("--restart-at", type=int, default=0, metavar="K",
                   help="also run the first layout stopped after step K and resumed")
    p.add_argument("--resume-layout", default=None,
                   help="resume the --restart-at run under this layout (default: the first)")
    p.add_argument("--rtol", type=float, default=1e-5,
                   help="relative tolerance on losses and on the parameter vector (default 1e-5)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=V",
                   help="override a spec field for every run (repeatable)")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/verify-<time>)")
    p.add_argument("--ledger", metavar="RUN_DIR", help="only audit the sample ledger of RUN_DIR")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.ledger:
        return _ledger(args.ledger)
    from shardwise.run.launch import WorkersFailed
    from shardwise.spec import load_spec
    from shardwise.verify.layouts import parse_layout
    from shardwise.verify.runner import compare, format_table, preflight_all, run_layout, run_layouts

    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: run at least 1 step.")
    if not math.isfinite(args.rtol) or args.rtol < 0:
        raise UserError(f"--rtol {args.rtol:g}: give a finite relative tolerance of at least 0 (0 asks "
                        "for exact agreement; the default 1e-5 allows float reassociation).")
    layouts = [parse_layout(name) for name in args.layouts.split(",") if name.strip()]
    if not layouts:
        raise UserError("--layouts is empty; name at least one layout, e.g. --layouts dp1,zero3-2.")
    if args.restart_at and not 0 < args.restart_at < args.steps:
        raise UserError(f"--restart-at {args.restart_at} must be between 1 and --steps - 1 = "
                        f"{args.steps - 1}, so that there is something to resume.")
    base = load_spec(args.config, args.overrides)  # config errors before any run starts
    invariant = base.run.determinism == "invariant"
    out = Path(args.out or f"runs/verify-{time.strftime('%Y%m%d-%H%M%S')}")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already holds files; pass a new --out folder.")
    runs = _plan(args, layouts, out)
    checked = preflight_all({r.name: r.spec for r in runs})  # every layout, before any trains
    outcomes = []
    try:  # the layouts (one launch per world size), then the stop-and-resume pair in order
        fresh = [r for r in runs if not r.resume and not r.name.endswith(STOP)]
        outcomes += run_layouts([(r.name, checked[r.name], r.run_dir) for r in fresh])
        for r in runs[len(fresh):]:
            outcome = run_layout(r.name, checked[r.name], r.run_dir, resume=r.resume)
            if not r.name.endswith(STOP):
                outcomes.append(outcome)
    except WorkersFailed as err:
        raise UserError(f"a verification run failed: {err}") from None
    reference = outcomes[0]
    rows = [compare(reference, o, args.rtol, invariant) for o in outcomes[1:]]
    mode = "bitwise (determinism = invariant)" if invariant else f"rtol {args.rtol:g}"
    print(format_table(rows, f"{reference.name}, {args.steps} steps, tolerance {mode}, "
                             f"runs in {out}"))
    for o in outcomes:
        for problem in o.ledger_problems[:5]:
            print(f"ledger {o.name}: {problem}")
    ok = all(r.passed for r in rows) and reference.ledger_exact
    print("verify: PASS" if ok else "verify: FAIL")
    return 0 if ok else 1


STOP = " (stop)"  # ends the name of the first half of the --restart-at run


class _Run(NamedTuple):
    name: str
    spec: Any  # RunSpec (imported lazily, like everything that pulls in torch)
    run_dir: Path
    resume: bool


def _plan(args: argparse.Namespace, layouts: list[Any], out: Path) -> list[_Run]:
    """Every run `verify` makes, in order, with its spec: each layout, then (with --restart-at)
    the first layout stopped after step K and its resume at --resume-layout, in one run dir."""
    from shardwise.verify.layouts import parse_layout
    from shardwise.verify.runner import layout_spec

    runs = [_Run(layout.name, layout_spec(args.config, args.overrides, layout, out / layout.name,
                                          args.steps), out / layout.name, False)
            for layout in layouts]
    if args.restart_at:
        first = layouts[0]
        second = parse_layout(args.resume_layout) if args.resume_layout else first
        name = f"{first.name}@{args.restart_at}->{second.name}"
        run_dir = out / name.replace(">", "").replace("@", "-stop")
        runs.append(_Run(f"{first.name}@{args.restart_at}{STOP}",
                         layout_spec(args.config, args.overrides, first, run_dir, args.steps,
                                     stop_at=args.restart_at), run_dir, False))
        runs.append(_Run(name, layout_spec(args.config, args.overrides, second, run_dir,
                                           args.steps), run_dir, True))
    return runs


def _ledger(path_text: str) -> int:
    from shardwise.data.ledger import LAUNCHES, LEDGER_DIR, audit

    run_dir = Path(path_text).expanduser()
    if not (run_dir / LEDGER_DIR / LAUNCHES).is_file():
        raise UserError(f"{path_text} has no sample ledger ({LEDGER_DIR}/{LAUNCHES} is missing): "
                        "pass a run directory made by `shardwise train`.")
    report = audit(run_dir)
    if report.exact:
        print(f"ledger exact: {report.steps} steps, {report.samples} samples, each used once "
              f"({report.launches} launch{'es' if report.launches != 1 else ''})")
        return 0
    print(f"ledger NOT exact: {len(report.problems)} problem(s) over {report.steps} steps")
    for problem in report.problems[:50]:
        print(f"  {problem}")
    return 1
