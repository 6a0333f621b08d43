"""`shardwise report RUN_DIR [RUN_DIR ...] [--out DIR]`: an HTML page of plots from a run's events;
with several runs, their loss curves overlaid (the layout-comparison view)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="write an HTML report (summary and plots) of one run, or compare runs",
        description="Read RUN_DIR/metrics.jsonl and write RUN_DIR/report/index.html: a summary "
                    "table and plots of loss, throughput and MFU, per-rank step time, "
                    "communication, memory and the run's events. The page is one file with its "
                    "pictures inside; it needs no network. With several run directories, their "
                    "loss curves are overlaid and the report goes to the first one (or --out).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories made by `shardwise train` (or their metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="directory to write index.html into "
                                                "(default: FIRST_RUN_DIR/report)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.report import build_report

    try:
        import matplotlib  # noqa: F401
    except ImportError as err:  # matplotlib is a dependency, but an environment may lack it
        raise UserError(f"`shardwise report` needs matplotlib, which cannot be imported ({err}). "
                        "Install it with `pip install matplotlib`.") from None
    target, runs = build_report(args.runs, Path(args.out).expanduser() if args.out else None)
    for run_ in runs:
        for note in run_.notes:
            print(f"note: {run_.name}: {note}", file=sys.stderr)
    print(f"report: {target}")
    return 0
