"""`shardwise verify --ledger RUN_DIR`: prove every sample of every step was used exactly once."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="audit a run's sample ledger",
                       description="Audit the sample ledger of a run: every sample of every step "
                                   "used exactly once across ranks, restarts and resumes included. "
                                   "Exit 0 when exact, 1 when a duplicate or omission is found.")
    p.add_argument("--ledger", metavar="RUN_DIR", required=True, help="the run directory to audit")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.data.ledger import LAUNCHES, LEDGER_DIR, audit

    run_dir = Path(args.ledger).expanduser()
    if not (run_dir / LEDGER_DIR / LAUNCHES).is_file():
        raise UserError(f"{args.ledger} has no sample ledger ({LEDGER_DIR}/{LAUNCHES} is missing): "
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
