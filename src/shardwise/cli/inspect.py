"""`shardwise inspect RUN_DIR|CHECKPOINT [OTHER] [--json]`: show a run's manifest, or what differs
between two runs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from shardwise.errors import UserError

MANIFEST = "manifest.json"  # the same name as shardwise.run.manifest.MANIFEST, without torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show the manifest of a run or checkpoint, or diff two",
                       description="Print what a run or checkpoint records to reproduce it (spec, "
                                   "data and code hashes, versions, topology, lineage). With two "
                                   "paths, print only what differs between them.")
    p.add_argument("path", help="a run directory or a checkpoint directory")
    p.add_argument("other", nargs="?", help="a second run or checkpoint to compare against")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verify-chain", action="store_true",
                   help="check the hash chain of the run's checkpoints (each meta.json records "
                        "the digest of the one before) and every file; name the first broken link")
    p.set_defaults(handler=run)


def load_manifest(path_text: str) -> dict[str, Any]:
    path = Path(path_text).expanduser()
    candidates = [path / MANIFEST]
    if path.is_file() and path.name == MANIFEST:
        candidates.insert(0, path)
    for candidate in candidates:
        if candidate.is_file():
            try:
                return json.loads(candidate.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise UserError(f"{candidate} is not a valid manifest ({err}). It may be "
                                "truncated; inspect a checkpoint's copy instead.") from None
    raise UserError(
        f"{path_text} is not a run or checkpoint directory: there is no {MANIFEST} in it. Pass a "
        "directory made by `shardwise train` (runs/NAME) or one of its checkpoints "
        "(runs/NAME/checkpoints/step-NNNNNN)."
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)}


def run(args: argparse.Namespace) -> int:
    if args.verify_chain:
        return verify_chain(args.path, args.other)
    first = load_manifest(args.path)
    if args.other:
        changes = diff(first, load_manifest(args.other))
        if args.json:
            print(json.dumps({k: {"a": a, "b": b} for k, (a, b) in changes.items()}, indent=2))
        elif not changes:
            print("no differences")
        else:
            width = max(len(k) for k in changes)
            for key, (a, b) in changes.items():
                print(f"{key:<{width}}  {_short(a)}  ->  {_short(b)}")
        return 0
    if args.json:
        json.dump(first, sys.stdout, indent=2)
        print()
        return 0
    print(_readable(first))
    return 0


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _container(info: dict[str, Any] | None) -> str:
    """The image a run ran in (the manifest records it; its torch decides the numbers)."""
    if not info:
        return "none (not in a container)"
    return f"{info.get('image') or 'unnamed image'} ({info.get('runtime') or 'unknown runtime'})"


def _readable(m: dict[str, Any]) -> str:
    topo, code, env, data = m["topology"], m["code"], m["environment"], m["data"]
    lines = [
        f"run            {m['run_id']}",
        f"spec           sha256 {m['spec_sha256'][:16]}…  seed {m['seed']}  precision {m['precision']}",
        f"data           {data['source']} ({data['path']})",
        f"               content {str(data['content_sha256'])[:16]}…  tokenizer "
        f"{str(data['tokenizer_sha256'])[:16]}…",
        f"code           shardwise {code['shardwise']}  git {str(code['git_commit'])[:12]}"
        f"{'  (dirty, diff ' + str(code['diff_sha256'])[:12] + ')' if code['dirty'] else ''}",
        f"environment    python {env['python']}  torch {env['torch']}  "
        f"{env['packages_count']} packages (sha256 {env['packages_sha256'][:12]}…)",
        f"topology       {topo['layout']}  world {topo['world_size']}  mesh "
        + " ".join(f"{k}={v}" for k, v in topo["mesh"].items()),
        f"container      {_container(env.get('container'))}",
        f"hosts          {', '.join(topo['hosts'])}",
        f"devices        {', '.join(sorted(set(topo['devices'])))}",
    ]
    if m["lineage"]:
        for entry in m["lineage"]:
            lines.append(f"resumed from   {entry['resumed_from']} (step {entry['step']}, "
                         f"{entry['layout']}, manifest {str(entry['manifest_sha256'])[:12]}…)")
    else:
        lines.append("lineage        fresh run (not resumed)")
    return "\n".join(lines)


def verify_chain(path_text: str, other: str | None) -> int:
    """`inspect --verify-chain RUN_DIR`: 0 when every link holds, 1 at the first broken one."""
    from shardwise.checkpoint import chain, registry
    from shardwise.checkpoint.discovery import run_checkpoints

    run_dir = Path(path_text).expanduser()
    if other is not None or not (run_dir / "checkpoints").is_dir():
        raise UserError(f"--verify-chain takes one run directory (runs/NAME, with checkpoints/ "
                        f"in it); got {path_text}{' and ' + other if other else ''}.")
    storage = run_checkpoints(run_dir)
    storage.recover()
    report = chain.verify(storage.root, storage.step_dirs())
    for line in report.lines:
        print(line)
    for entry in registry.read(storage.root):  # a registered digest vouches for its checkpoint
        meta = storage.root / entry.checkpoint / "meta.json"
        found = chain.digest(meta.read_text()) if meta.exists() else None
        if found != entry.meta_sha256 and report.broken is None:
            report.broken = (f"{entry.checkpoint}: registered as {entry.name!r} with meta.json "
                             f"{entry.meta_sha256[:16]}…, now "
                             f"{'missing' if found is None else found[:16] + '…'}")
    if report.broken is not None:
        print(f"chain: BROKEN at {report.broken}")
        return 1
    head = f"; newest meta.json sha256 {report.head_sha256}" if report.head_sha256 else ""
    print(f"chain: OK ({report.links} link{'s' if report.links != 1 else ''} checked; "
          f"{report.stop}){head}")
    return 0
