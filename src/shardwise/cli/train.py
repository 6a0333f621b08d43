"""`shardwise train [CONFIG] [--set section.key=value ...] [--nproc N] [--resume RUN_DIR]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardwise.errors import UserError
from shardwise.spec.runspec import RunSpec


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (the embedded Shakespeare GPT when no config is given)",
        description="Train the run a RunSpec describes. Without CONFIG, the embedded default: a "
                    "small GPT on the Shakespeare plays, FSDP on 2 local workers.")
    p.add_argument("config", nargs="?", help="RunSpec TOML file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=V",
                   help="override one spec field, e.g. --set optimizer.lr=1e-3 (repeatable)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local worker processes (default: parallel.nproc; 0 = one per GPU, 2 on CPU)")
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its newest checkpoint")
    p.add_argument("--from", dest="branch_from", metavar="NAME|STEP",
                   help="with --resume: continue from this registered (`shardwise register`) or "
                        "older committed checkpoint; the newer ones are moved aside, never loaded")
    p.add_argument("--print-spec", action="store_true",
                   help="print the resolved spec as TOML and exit without training")
    p.add_argument("--print-placement", "--print-plan", dest="print_placement", action="store_true",
                   help="print where the layout puts every parameter (stages, tp and data-"
                        "parallel sharding, FSDP units, tied groups) and exit without training "
                        "(--print-plan is its old name)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.parallel.distributed import under_launcher
    from shardwise.run import rundir
    from shardwise.spec import load_spec

    if args.resume and args.config:
        raise UserError(
            f"pass either a CONFIG ({args.config}) or --resume {args.resume}, not both: a resumed "
            "run keeps the spec saved in its run directory. Change fields of it with --set.")
    if args.branch_from is not None and not args.resume:
        raise UserError(
            f"--from {args.branch_from} continues an existing run from one of its checkpoints: "
            "give the run with it, `shardwise train --resume RUN_DIR --from "
            f"{args.branch_from}`.")
    if args.nproc is not None:
        if args.nproc < 1:
            raise UserError(f"--nproc {args.nproc}: the number of workers must be at least 1.")
        args.overrides.append(f"parallel.nproc={args.nproc}")
    if args.resume:
        run_dir = rundir.existing_run_dir(args.resume)
        spec = rundir.load_run_spec(run_dir, args.overrides)
    else:
        spec = load_spec(args.config, args.overrides)

    if under_launcher():  # torchrun started us: every rank runs this; the launcher owns the world
        if args.branch_from is not None:
            raise UserError(
                f"--from {args.branch_from} moves checkpoints, which every torchrun worker would "
                "do at once. Make the branch once outside torchrun (`shardwise train --resume "
                f"{args.resume} --from {args.branch_from}`, with --set run.stop_at=N to train "
                "only a little there), then start torchrun with --resume alone.")
        from shardwise.run.worker import run_under_torchrun

        run_under_torchrun(spec, args.resume)
        return 0
    return _launch(spec, args.resume, args.print_spec, args.print_placement, args.branch_from)


def _launch(spec: RunSpec, resume: str | None, print_spec: bool, print_placement: bool,
            branch_from: str | None = None) -> int:
    from shardwise.run.launch import Preempted, WorkersFailed, start_run
    from shardwise.run.preflight import placement_preview, preflight
    from shardwise.spec import spec_to_toml

    spec, dims = preflight(spec)
    if print_spec or print_placement:
        sys.stdout.write(spec_to_toml(spec) if print_spec else placement_preview(spec, dims))
        return 0
    try:
        run_dir = start_run(spec, dims, resume, branch_from)
    except Preempted as err:  # not an error: one line, exit code 75, resume later
        print(err, file=sys.stderr)
        return err.exit_code
    except WorkersFailed as err:
        from shardwise.cli.output import print_error

        print_error(str(err))
        return err.exit_code
    _print_summary(run_dir)
    return 0


def _print_summary(run_dir: Path) -> None:
    """Read the run's own events back, so the summary is the same however it was launched."""
    end = None
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            event = json.loads(line)
            if event["kind"] == "run_end":
                end = event
    if end is None:
        return
    from shardwise.telemetry.progress import held_out_text

    lines = [f"finished step {end['step']} in {end['wall_s']:.1f} s"]
    if end.get("val_loss") is not None:
        lines.append(held_out_text(end))
    if end.get("sample"):
        lines.append("sample:\n" + end["sample"])
    lines.append(f"outputs: {run_dir}/ (spec.toml, metrics.jsonl, tb/, checkpoints/, trace/); "
                 f"plots: shardwise report {run_dir}")
    print("\n".join(lines))
