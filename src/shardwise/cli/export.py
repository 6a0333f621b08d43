"""`shardwise export CHECKPOINT --format safetensors [--out DIR]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as one consolidated model file",
                       description="Consolidate a sharded checkpoint (written at any layout) into "
                                   "one safetensors file with config.json and tokenizer.json.")
    p.add_argument("checkpoint", help="a checkpoint directory, e.g. runs/NAME/checkpoints/step-000500")
    p.add_argument("--format", default="safetensors", help="only safetensors for now")
    p.add_argument("--out", default=None,
                   help="output folder (default: RUN_DIR/export/step-NNNNNN)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.format != "safetensors":
        raise UserError(f"--format {args.format!r} is not supported; use --format safetensors.")
    from shardwise.checkpoint.export import export_safetensors

    checkpoint = Path(args.checkpoint).expanduser()
    out = Path(args.out).expanduser() if args.out else \
        checkpoint.parent.parent / "export" / checkpoint.name
    from shardwise.checkpoint.integrity import META
    from shardwise.run import rundir

    spec = rundir.load_run_spec(checkpoint.parent.parent, []) \
        if (checkpoint / META).is_file() else None  # export names what is missing otherwise
    model_file = export_safetensors(checkpoint, out, spec)
    print(f"wrote {model_file} ({model_file.stat().st_size:,} bytes), {out / 'config.json'}")
    return 0
