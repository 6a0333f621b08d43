"""`shardwise status RUN_DIR`: the Slurm job's state and the run's last step, loss and
throughput."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status", help="a run's Slurm job state and its last step, loss and throughput",
        description="Report the state of the Slurm job that `shardwise launch --slurm` submitted "
                    "for RUN_DIR (squeue, then sacct), and the last logged step, loss and "
                    "throughput from RUN_DIR/metrics.jsonl.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.cluster.status import report

    print(report(Path(args.run_dir).expanduser()))
    return 0
