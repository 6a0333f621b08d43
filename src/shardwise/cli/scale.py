"""`shardwise scale CONFIG --world 1,2,4`: the same job at several world sizes, and how it scales.

    shardwise scale examples/default.toml --world 1,2,4 --steps 100
    shardwise scale CONFIG --world 2,4,8 --weak --target-loss 5.0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "scale", help="run one job at several world sizes and report how it scales",
        description="Train the job CONFIG describes at each world size of --world, one after "
                    "another through the same launcher as `shardwise train`, and report per "
                    "size: tokens/s, scaling efficiency, communication share of the step time "
                    "and time to the target loss, with a plot (OUT/index.html) and OUT/scale.json."
                    " Strong scaling (the default) keeps the global batch; --weak keeps the "
                    "batch per rank.")
    p.add_argument("config", nargs="?", help="RunSpec TOML (default: the embedded default)")
    p.add_argument("--world", required=True, metavar="N,N,...",
                   help="world sizes (local workers), e.g. 1,2,4")
    p.add_argument("--weak", action="store_true",
                   help="weak scaling: global batch = the config's x world / smallest world")
    p.add_argument("--steps", type=int, default=None, help="run.steps of every run")
    p.add_argument("--target-loss", type=float, default=None, metavar="LOSS",
                   help="held-out loss that counts as trained (default: eval.target_loss)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=V", help="override a spec field for every run (repeatable)")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/scale-<time>)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.study.scale import parse_worlds, preflight_all, run_all, scale_specs

    worlds = parse_worlds(args.world)
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: run at least 1 step.")
    if args.target_loss is not None and not args.target_loss > 0:
        raise UserError(f"--target-loss {args.target_loss}: give a held-out loss above 0.")
    out = Path(args.out or f"runs/scale-{time.strftime('%Y%m%d-%H%M%S')}").expanduser()
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already holds files; pass a new --out folder.")
    runs = scale_specs(args.config, args.overrides, worlds, args.weak, args.steps, out)
    preflight_all(runs, args.weak)  # every size checked before any trains
    from shardwise.run.launch import WorkersFailed

    try:
        run_all(runs)
    except WorkersFailed as err:
        done = [r.world for r in runs if r.launch_s is not None]
        raise UserError(f"a scaling run failed: {err} The sizes that finished ({done or 'none'}) "
                        f"are in {out}.") from None
    return report(runs, args, out)


def report(runs: list, args: argparse.Namespace, out: Path) -> int:
    from shardwise.compare import compare_runs, load_run_data
    from shardwise.compare.scaling import STRONG, WEAK, as_dict, render, scale_points
    from shardwise.report.scaling import write_scaling_page

    data = [(r.world, load_run_data(str(r.run_dir)), r.launch_s) for r in runs]
    target = args.target_loss if args.target_loss is not None else \
        (data[0][1].facts.get("eval.target_loss") or None)
    mode = WEAK if args.weak else STRONG
    points = scale_points(data, target)
    (out / "scale.json").write_text(json.dumps(as_dict(points, mode, target), indent=2))
    comparison = compare_runs([d for _, d, _ in data], target_loss=target)
    page = write_scaling_page(points, mode, target, [d.run for _, d, _ in data], comparison, out)
    if args.json:
        print(json.dumps(as_dict(points, mode, target), indent=2))
        return 0
    print(render(points, mode, target))
    print("comparison of the runs: " + ("controlled (only infrastructure differs)"
                                        if comparison.controlled else
                                        "not controlled: " + ", ".join(sorted(
                                            {d.name for d in comparison.blocking}))))
    print(f"report: {page}")
    return 0
