"""`shardwise audit RUN_DIR`: is the held-out split disjoint from every sample the run trained on,
by content? Exact duplicates (sequence hashes) and near-duplicates (the share of a held-out
sequence's token shingles that the run trained on). Exit 0 when disjoint, 1 when not, 2 on a user error.

    shardwise audit runs/NAME
    shardwise audit runs/NAME --threshold 0.8 --shingle 13
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit", help="is the held-out split disjoint from what a run trained on (by content)",
        description="Read RUN_DIR's sample ledger and data and check that no held-out sequence "
                    "equals a trained one (content hashes of the token ids) or is mostly "
                    "contained in the trained data (at least --threshold of its n-token "
                    "shingles occur in trained sequences). Writes RUN_DIR/audit.json, which "
                    "`shardwise report` shows. Exit 0 when disjoint, 1 when not.")
    p.add_argument("run", metavar="RUN_DIR", help="a run directory made by `shardwise train`")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="share of a held-out sequence's shingles found in trained sequences "
                        "that makes it a near-duplicate (default 0.5)")
    p.add_argument("--shingle", type=int, default=8,
                   help="tokens per shingle for near-duplicates (default 8)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if not 0 < args.threshold <= 1:
        raise UserError(f"--threshold {args.threshold}: it is a share of a sequence's shingles; "
                        "give a value in (0, 1] (0.5 is the default; 0.9 reports only near-"
                        "complete copies).")
    if args.shingle < 1:
        raise UserError(f"--shingle {args.shingle}: a shingle is at least 1 token (8 is the "
                        "default; longer shingles find only longer copies).")
    from shardwise.study.audit import render, result_dict, run_audit, write_result

    audit = run_audit(Path(args.run).expanduser(), args.threshold, args.shingle)
    written = write_result(audit)
    if args.json:
        print(json.dumps(result_dict(audit), indent=2))
    else:
        print(render(audit))
    if written is None:
        print(f"note: {args.run} is not writable, so {args.run}/audit.json was not written "
              "(`shardwise report` will not show this audit)", file=sys.stderr)
    return 0 if audit.report.passed else 1
