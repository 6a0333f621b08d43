"""A run directory as a comparison reads it: the resolved spec, the manifest and the events, and
the flat list of facts (`section.key` -> value) two runs are compared on.

The facts come from three places, each for what only it knows: `spec.toml` (everything the run
was asked to do, data hashes pinned), `manifest.json` (the code, environment, hardware and model
source it actually ran with) and `metrics.jsonl` (the tokens it actually trained on and the
held-out targets it evaluated). Paths are left out where a content hash identifies the same thing:
the same corpus copied elsewhere is the same data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, UserError
from shardwise.telemetry.readback import Run, load_run, num

SPEC = "spec.toml"
MANIFEST = "manifest.json"
#: facts the run recorded (manifest, events) rather than was asked for (spec)
RECORDED = ("code.", "environment.", "topology.", "model.source.", "data.code.", "hooks.",
            "budget.", "eval.tokens")


@dataclass
class RunData:
    """One run: where it is, what it was asked (`spec`), what it ran with (`manifest`, None when
    the run predates manifests or died before writing one) and what it recorded (`run`)."""

    path: Path
    spec: dict[str, Any]
    manifest: dict[str, Any] | None
    run: Run
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def seed(self) -> Any:
        return self.facts.get("run.seed")


def load_run_data(path_text: str, require_record: bool = True) -> RunData:
    """Read a run directory. `require_record`: a missing or unreadable spec.toml or
    manifest.json is a UserError (the comparison cannot tell what the run was); else it is a
    note on the run, which then is not taken for the same job as any other (`report A B`)."""
    run = load_run(path_text)  # checks the directory and its metrics.jsonl
    try:
        spec = _read_spec(run.run_dir, require_record)
    except UserError as err:
        if require_record:
            raise
        run.notes.append(str(err))
        spec = {}
    try:
        manifest = _read_manifest(run.run_dir, require_record)
    except UserError as err:
        if require_record:
            raise
        run.notes.append(str(err))
        manifest = None
    if not spec:
        run.notes.append(f"no readable {SPEC}: what the run was asked to do is unknown, so "
                         "whether it may be compared with others cannot be checked.")
    data = RunData(run.run_dir, spec, manifest, run)
    data.facts = facts_of(data)
    return data


def _read_spec(run_dir: Path, required: bool) -> dict[str, Any]:
    from shardwise.spec.load import spec_from_dict
    from shardwise.spec.toml import read_toml

    path = run_dir / SPEC
    if not path.is_file():
        if required:
            raise UserError(f"{run_dir} has no {SPEC}, so what the run was asked to do (data, "
                            "optimizer, budget, layout) is unknown and it cannot be compared. "
                            "Pass a run directory made by `shardwise train`.")
        return {}
    try:
        return spec_from_dict(read_toml(path), origin=str(path)).to_dict()
    except SpecError as err:
        raise UserError(f"cannot read {path}: {err} A run written by another shardwise version "
                        "may need that version to compare it.") from None


def _read_manifest(run_dir: Path, required: bool) -> dict[str, Any] | None:
    path = run_dir / MANIFEST
    if not path.is_file():
        if required:
            raise UserError(f"{run_dir} has no {MANIFEST}: the code, hardware and data hashes "
                            "it ran with are unknown, so it cannot be compared. The manifest is "
                            "written when a run's first launch starts; pass a run that started.")
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise UserError(f"{path} is not a readable manifest ({err}); it may be truncated. "
                        "Restore it from one of the run's checkpoints (each holds a copy).") from None
    return manifest if isinstance(manifest, dict) else None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; tuples become lists, so a value reads the same
    whether it came from TOML or JSON."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, tuple):
        tree = list(tree)
    return {prefix[:-1]: tree}


def facts_of(data: RunData) -> dict[str, Any]:
    """Every fact of the run, by name (see the module docstring)."""
    facts = flatten(data.spec)
    if data.manifest is not None:
        facts.update(_manifest_facts(data.manifest))
    facts.update(_event_facts(data.run))
    return facts


def _manifest_facts(m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    data = m.get("data") or {}
    if data.get("content_sha256"):
        out["data.content_hash"] = data["content_sha256"]
    if data.get("tokenizer_sha256"):
        out["data.tokenizer_hash"] = data["tokenizer_sha256"]
    out.update(flatten(data.get("code") or {}, "data.code."))
    model = m.get("model") or {}
    out.update(flatten(model.get("source") or {}, "model.source."))
    for i, hook in enumerate(m.get("hooks") or []):
        out.update(flatten(hook, f"hooks.{i}."))
    out.update(flatten(m.get("code") or {}, "code."))
    env = m.get("environment") or {}
    for key in ("python", "torch", "packages_sha256", "platform"):
        if key in env:
            out[f"environment.{key}"] = env[key]
    out.update(flatten(env.get("container") or {}, "environment.container."))
    topo = m.get("topology") or {}
    for key in ("world_size", "layout"):
        if key in topo:
            out[f"topology.{key}"] = topo[key]
    if topo.get("hosts") is not None:
        out["topology.hosts"] = len(topo["hosts"])
    if topo.get("devices") is not None:
        out["topology.devices"] = ", ".join(sorted(set(map(str, topo["devices"]))))
    return out


def _event_facts(run: Run) -> dict[str, Any]:
    """What the run actually trained on and evaluated, from its events."""
    out: dict[str, Any] = {}
    tokens = final_tokens(run)
    if tokens is not None:
        out["budget.tokens"] = tokens
    evals = [e for e in run.evals() if num(e, "eval_tokens") is not None]
    if evals:
        out["eval.tokens"] = int(num(evals[-1], "eval_tokens") or 0)
    return out


def final_tokens(run: Run) -> int | None:
    """Tokens trained by the end of the run: the last run_end's count, else the last step
    event's (a run cut off before its end)."""
    ends = [v for e in run.of("run_end") if (v := num(e, "tokens_seen")) is not None]
    steps = [v for e in run.steps() if (v := num(e, "tokens_seen")) is not None]
    best = max([*ends, *steps], default=None)
    return None if best is None else int(best)
