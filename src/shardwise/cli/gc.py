"""`shardwise gc`: retention across runs (keep registered, the newest N, every K-th step) on disk
and S3, and a data-removal request against a dataset's derived caches. `--dry-run` lists what
would go; nothing else is ever deleted."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gc", help="delete old checkpoints across runs, or a dataset's derived caches",
        description="Apply retention to the checkpoints of runs (run directories, a directory "
                    "of them, checkpoint locations, s3:// prefixes): keep every registered "
                    "checkpoint, the newest --keep-last and every --keep-every-th step, delete "
                    "the rest. A location a running launch holds is not touched. With --data, "
                    "delete a dataset's token caches and tokenizer for a data-removal request "
                    "and record it in CACHE_ROOT/deletions.jsonl.")
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="runs/NAME, runs/, RUN_DIR/checkpoints or s3://BUCKET/PREFIX")
    p.add_argument("--keep-last", type=int, default=3, metavar="N",
                   help="keep the newest N committed checkpoints of each location (default 3)")
    p.add_argument("--keep-every", type=int, default=0, metavar="K",
                   help="also keep every step that is a multiple of K (default 0: none)")
    p.add_argument("--drop-abandoned", action="store_true",
                   help="also delete the checkpoints a branch (train --resume --from) left behind")
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted; delete nothing")
    p.add_argument("--endpoint-url", default="", help="S3-compatible endpoint for s3:// paths")
    p.add_argument("--region", default="", help="S3 region for s3:// paths")
    p.add_argument("--profile", default="", help="a profile of ~/.aws/credentials for s3:// paths")
    p.add_argument("--data", metavar="RUN_DIR|HASH|SOURCE",
                   help="delete the derived caches (token arrays, tokenizer) of this dataset")
    p.add_argument("--allow-rebuild", metavar="RUN_DIR|HASH|SOURCE",
                   help="let runs rebuild the caches of a dataset --data deleted")
    p.add_argument("--reason", default="", help="why (recorded; required with --data)")
    p.add_argument("--by", default=None, help="who asks (recorded; default user@host)")
    p.add_argument("--cache-dir", default="",
                   help="the cache root (default: the run's data.cache_dir, $SHARDWISE_CACHE or "
                        "~/.cache/shardwise)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from shardwise.errors import UserError

    modes = [bool(args.paths), args.data is not None, args.allow_rebuild is not None]
    if sum(modes) != 1:
        raise UserError("gc does one thing at a time: give checkpoint locations (`shardwise gc "
                        "runs/ --keep-last 2`), or --data DATASET --reason TEXT, or "
                        "--allow-rebuild DATASET --reason TEXT.")
    if args.paths:
        return _checkpoints(args)
    from shardwise.run import forget

    if args.allow_rebuild is not None:
        record = forget.allow_rebuild(forget.resolve(args.allow_rebuild, args.cache_dir),
                                      args.reason, args.by)
        print(json.dumps(record) if args.json else
              f"allowed: runs may rebuild the caches of {record['content_sha256'][:16]}… again "
              "(recorded)")
        return 0
    dataset = forget.resolve(args.data, args.cache_dir)
    record = forget.delete(dataset, args.reason, args.by, args.dry_run)
    if args.json:
        print(json.dumps(record))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for item in record["deleted"]:
        print(f"{verb}  {item['path']}  ({_mb(item['bytes'])})")
    if not record["deleted"]:
        print(f"no derived caches of {dataset.content_hash[:16]}… in {dataset.root}")
    if not args.dry_run:
        print(f"recorded in {dataset.root}/deletions.jsonl: runs that need this data are "
              "refused until `shardwise gc --allow-rebuild` lifts it")
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.location import StorageSpec
    from shardwise.run import retention

    policy = retention.Policy(args.keep_last, args.keep_every, args.drop_abandoned).check()
    found = retention.locations(args.paths, StorageSpec("", args.endpoint_url, args.region,
                                                        args.profile))
    plans = [retention.plan(label, storage, policy) for label, storage in found]
    deleted: list[str] = []
    if not args.dry_run:
        for plan in plans:
            deleted += retention.apply(plan)
    if args.json:
        print(json.dumps([{"location": str(p.storage.root), "skipped": p.skipped,
                           "keep": [k for k, _ in p.keep],
                           "delete": [str(loc) for loc, _, _ in p.delete] if not p.skipped else []}
                          for p in plans], indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for plan in plans:
        print(f"{plan.storage.root}" + (f"  ({plan.label})" if plan.label != str(plan.storage.root)
                                        else ""))
        if plan.skipped:
            print(f"  skipped: {plan.skipped}")
            continue
        for name, why in plan.keep:
            print(f"  keep    {name}  {why}")
        for loc, why, size in plan.delete:
            print(f"  {verb}  {loc.name}  {why}  ({_mb(size)})")
    total = sum(p.bytes for p in plans if not p.skipped)
    count = sum(len(p.delete) for p in plans if not p.skipped)
    skipped = sum(1 for p in plans if p.skipped)
    print(f"{verb} {count} checkpoint{'s' if count != 1 else ''} ({_mb(total)}) in "
          f"{len(plans)} location{'s' if len(plans) != 1 else ''}"
          f"{f'; {skipped} skipped (in use)' if skipped else ''}")
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"
