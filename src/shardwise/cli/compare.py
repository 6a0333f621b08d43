"""`shardwise compare RUN_A RUN_B [RUN ...]`: may these runs be compared, and which is better.

    shardwise compare runs/zero3 runs/ddp
    shardwise compare runs/a-s1 runs/a-s2 runs/b-s1 runs/b-s2 --target-loss 4.6
    shardwise compare runs/a runs/b --allow optimizer.lr --json

Exit codes: 0 a controlled comparison (only infrastructure differs, or what --allow accepts),
3 not controlled (the figures are shown, no winner is called), 2 a user error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shardwise.errors import UserError

if TYPE_CHECKING:
    from shardwise.compare import Comparison

NOT_CONTROLLED = 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="is a comparison of runs controlled, and which run is better",
        description="Decide whether runs may be compared — same data and tokenizer, held-out "
                    "split, model, optimizer and schedule, global batch and token budget, "
                    "evaluation; only infrastructure (layout, precision, kernels, hardware, code) "
                    "may differ — and score them side by side: held-out loss at equal tokens "
                    "against the seed spread, tokens and time to a target loss, throughput and "
                    "MFU, step-time tail, memory, communication, checkpoints, restarts, energy "
                    "and cost. Runs that differ only in run.seed form one side. Exit 0 when the "
                    "comparison is controlled, 3 when it is not (no winner is called).")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="run directories made by `shardwise train` (at least two)")
    p.add_argument("--allow", action="append", default=[], metavar="FIELD",
                   help="accept a difference that is not infrastructure, knowingly (a field such "
                        "as optimizer.lr, or a section such as optimizer; repeatable)")
    p.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                   help="held-out loss that counts as trained (default: eval.target_loss of the "
                        "first run's spec)")
    p.add_argument("--noise", type=float, default=None, metavar="SIGMA",
                   help="seed-to-seed standard deviation of held-out loss, measured before (e.g. "
                        "with `shardwise compare` over runs that differ only in their seed)")
    p.add_argument("--price", type=float, default=None, metavar="PER_DEVICE_HOUR",
                   help="price of one device-hour (default: telemetry.price_per_device_hour)")
    p.add_argument("--out", metavar="DIR",
                   help="where to write index.html and comparison.json (default: "
                        "FIRST_RUN_DIR/compare)")
    p.add_argument("--no-page", action="store_true",
                   help="only print: write no index.html and comparison.json (read-only runs, "
                        "scripts)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.compare import compare_runs, load_run_data
    from shardwise.compare.fields import check_allow
    from shardwise.compare.text import as_dict, render

    if len(args.runs) < 2:
        raise UserError("compare needs at least two run directories (RUN_A RUN_B ...); to read "
                        f"one run, use `shardwise report {args.runs[0]}`.")
    _check_numbers(args)
    if len({Path(p).expanduser().resolve() for p in args.runs}) < len(args.runs):
        raise UserError("the same run directory is given twice; each run counts once (its "
                        "figures would weigh double). Remove the repeat.")
    runs = [load_run_data(p) for p in args.runs]  # every input checked before any output
    problem = check_allow(args.allow, set().union(*(r.facts for r in runs)))
    if problem:
        raise UserError(problem)
    comparison = compare_runs(runs, args.allow, args.target_loss, args.noise, args.price)
    if args.no_page and args.out:
        raise UserError("--no-page writes nothing, so --out has nowhere to matter; drop one.")
    page = None if args.no_page else _write_outputs(
        comparison, Path(args.out).expanduser() if args.out else runs[0].path / "compare")
    if args.json:
        print(json.dumps(as_dict(comparison), indent=2, default=str))
    else:
        print(render(comparison))
        if page is not None:
            print(f"report: {page}")
    for r in runs:
        for note in r.run.notes:
            print(f"note: {r.name}: {note}", file=sys.stderr)
    return 0 if comparison.controlled else NOT_CONTROLLED


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value in (("--target-loss", args.target_loss), ("--noise", args.noise),
                        ("--price", args.price)):
        if value is not None and not value >= 0:
            raise UserError(f"{flag} {value}: give a number of at least 0.")
    if args.noise == 0:
        raise UserError("--noise 0 would call every difference significant; give the seed-to-seed "
                        "standard deviation you measured (greater than 0), or leave it out.")


def _write_outputs(comparison: Comparison, out: Path) -> Path:
    """index.html and comparison.json into `out`."""
    from shardwise.compare.text import as_dict
    from shardwise.report.scorecard import write_comparison_page

    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "comparison.json").write_text(json.dumps(as_dict(comparison), indent=2,
                                                        default=str))
    except OSError as err:
        raise UserError(f"cannot write the comparison into {out}: {err.strerror or err}. Pass "
                        "--out DIR with a writable folder.") from None
    return write_comparison_page(comparison, out)
