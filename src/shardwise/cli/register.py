"""`shardwise register RUN_DIR [--step N] --name NAME` and `shardwise registry RUN_DIR [...]`:
name a committed checkpoint (kept by every retention, loadable with `train --resume --from`), and
list the named ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "register", help="register a committed checkpoint under a name (kept from retention)",
        description="Register a committed checkpoint of a run as a named artifact, with its "
                    "manifest and evaluation results: in the registry file next to the "
                    "checkpoints, and in the MLflow model registry when mlflow is installed "
                    "and a tracking URI is configured. Retention and `shardwise gc` keep it; "
                    "`shardwise train --resume RUN_DIR --from NAME` continues from it.")
    p.add_argument("run_dir", help="the run directory (runs/NAME)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest committed checkpoint)")
    p.add_argument("--name", required=True, help="the name: a letter, then letters, digits, . _ -")
    p.set_defaults(handler=run_register)
    q = sub.add_parser("registry", help="list the registered checkpoints of runs",
                       description="List the checkpoints registered in each run's location: "
                                   "name, step, held-out loss, when and by whom.")
    q.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(handler=run_list)


def run_register(args: argparse.Namespace) -> int:
    from shardwise.run.register import register

    entry = register(Path(args.run_dir).expanduser(), args.name, args.step)
    evals = entry.record.get("eval", {})
    loss = f", held-out loss {evals['val_loss']:.4f}" if "val_loss" in evals else \
        " (no held-out evaluation at that step)"
    where = f"; MLflow model {entry.name} version {entry.record['mlflow']['version']}" \
        if "mlflow" in entry.record else ""
    print(f"registered {entry.checkpoint} (step {entry.step}{loss}) as {entry.name!r} in "
          f"{entry.record['location'].rsplit('/', 1)[0]}/registry.json{where}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import registry
    from shardwise.checkpoint.discovery import run_checkpoints
    from shardwise.errors import UserError

    rows: list[dict[str, Any]] = []
    for text in args.run_dirs:
        run_dir = Path(text).expanduser()
        if not (run_dir / "checkpoints").is_dir():
            raise UserError(f"{text} is not a run directory with checkpoints (no checkpoints/ "
                            "in it). Pass directories that `shardwise train` created.")
        for entry in registry.read(run_checkpoints(run_dir).root):
            rows.append({"run": str(run_dir), **entry.to_dict()})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no registered checkpoints")
        return 0
    print(f"{'name':<20} {'step':>7}  {'val_loss':>8}  {'registered':<20}  {'by':<20}  checkpoint")
    for row in rows:
        loss = row.get("eval", {}).get("val_loss")
        print(f"{row['name']:<20} {row['step']:>7}  {'' if loss is None else f'{loss:.4f}':>8}  "
              f"{row.get('registered_at', ''):<20}  {row.get('by', ''):<20}  "
              f"{row['run']}/{row['checkpoint']}"
              f"{'  (abandoned line)' if '/' in row['checkpoint'] else ''}")
    return 0
