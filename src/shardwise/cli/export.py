"""`shardwise export RUN_OR_CHECKPOINT --format safetensors|hf [--out DIR] [--dtype D]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.errors import UserError

FORMATS = ("safetensors", "hf")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as one consolidated model file",
                       description="Consolidate a sharded checkpoint (written at any layout) into "
                                   "one safetensors file with config.json and tokenizer.json "
                                   "(--format safetensors), or into a directory that "
                                   "transformers' from_pretrained loads (--format hf).")
    p.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step-000500) "
                                      "or a run directory (its newest checkpoint that verifies)")
    p.add_argument("--format", default="safetensors", help="safetensors (default) or hf")
    p.add_argument("--dtype", default="", help="--format hf: float32, bfloat16 or float16 "
                                               "(default: the weights' source dtype)")
    p.add_argument("--out", default=None,
                   help="output folder (default: RUN_DIR/export/step-NNNNNN)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise UserError(f"--format {args.format!r} is not supported; use --format safetensors "
                        "or --format hf.")
    if args.dtype and args.format != "hf":
        raise UserError("--dtype applies to --format hf only.")
    from shardwise.checkpoint.discovery import checkpoint_at
    from shardwise.run import rundir
    from shardwise.run.export import export_hf_dir, export_safetensors

    checkpoint = checkpoint_at(Path(args.checkpoint).expanduser())
    out = Path(args.out).expanduser() if args.out else \
        checkpoint.run_dir / "export" / checkpoint.name
    spec = rundir.load_run_spec(checkpoint.run_dir, []) \
        if (checkpoint.run_dir / rundir.SPEC_FILE).is_file() else None  # export says what is missing
    if args.format == "hf":
        model_file = export_hf_dir(checkpoint, out, spec, args.dtype)
        print(f"wrote {out} (from_pretrained loads it; {model_file.name} "
              f"{model_file.stat().st_size:,} bytes)")
        return 0
    model_file = export_safetensors(checkpoint, out, spec)
    print(f"wrote {model_file} ({model_file.stat().st_size:,} bytes), {out / 'config.json'}")
    return 0

