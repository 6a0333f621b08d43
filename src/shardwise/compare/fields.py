"""Which differences between runs are infrastructure, and which make a comparison uncontrolled.

Infrastructure is how a run computes — layout, precision policy, kernels, memory tricks, hardware,
code and library versions, checkpointing, telemetry, fault handling — not what it computes.
Everything else (data and tokenizer, held-out split, model, optimizer and schedule, global batch,
token budget, evaluation) must be equal for a comparison to be controlled: a run that saw more
data or another learning rate is not evidence about infrastructure. A field nobody classified is
"everything else", so a new field can only make the check stricter. `run.seed` is its own kind:
a different seed is noise, not a confound, and the quality verdict accounts for it through the
seed spread.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shardwise.compare.runs import RECORDED

INFRASTRUCTURE = "infrastructure"
OTHER = "everything else"
SEED = "seed"
IGNORED = "ignored"

#: how a run computes, not what: `fnmatch` patterns over fact names
INFRASTRUCTURE_FIELDS = (
    "parallel.*", "run.precision", "run.tf32", "run.determinism", "memory.*", "loss_scale.*",
    "optimizer.implementation", "batch.micro_batch", "model.init", "checkpoint.*", "log.*",
    "telemetry.*", "fit.*", "failure.*", "topology.*", "code.*", "environment.*",
    "model.source.shardwise", "model.source.transformers", "model.source.package",
    "model.source.version", "data.cache_dir",
)
#: names, places and reporting choices that change nothing about the training or its evaluation
IGNORED_FIELDS = (
    "run.name", "run.dir", "sample.*", "eval.target_loss", "model.source.file",
    "model.source.config", "model.source.hf_path", "data.code.file", "hooks.*.file",
)
#: identified by a content hash when both runs have one (a copied corpus is the same corpus)
PATH_FIELDS = {"data.source": "data.content_hash", "data.tokenizer": "data.tokenizer_hash"}


def kind_of(name: str) -> str:
    if name == "run.seed":
        return SEED
    if any(fnmatch.fnmatchcase(name, p) for p in IGNORED_FIELDS):
        return IGNORED
    if any(fnmatch.fnmatchcase(name, p) for p in INFRASTRUCTURE_FIELDS):
        return INFRASTRUCTURE
    return OTHER


@dataclass
class Difference:
    """One fact whose value is not the same everywhere: its value per side (or per run)."""

    name: str
    values: list[Any]
    kind: str
    allowed: bool = False

    @property
    def blocks(self) -> bool:
        """Whether this difference makes the comparison uncontrolled."""
        return self.kind == OTHER and not self.allowed


def differences(facts: list[dict[str, Any]], allow: Sequence[str] = ()) -> list[Difference]:
    """Every fact (not ignored) whose value differs between the given fact sets, in name order;
    a fact one set lacks counts as missing (None). Path facts are skipped where their content
    hashes are known for all."""
    names = sorted(set().union(*facts))
    out = []
    for name in names:
        kind = kind_of(name)
        if kind == IGNORED or _identified_by_hash(name, facts):
            continue
        values = [f.get(name) for f in facts]
        if any(v != values[0] for v in values[1:]):
            out.append(Difference(name, values, kind, allowed=is_allowed(name, allow)))
    return out


def _identified_by_hash(name: str, facts: list[dict[str, Any]]) -> bool:
    key = PATH_FIELDS.get(name)
    return key is not None and all(f.get(key) for f in facts)


def is_allowed(name: str, allow: Sequence[str]) -> bool:
    """`--allow optimizer.lr` accepts that field, `--allow optimizer` (or `optimizer.*`) every
    field of the section."""
    for pattern in allow:
        pattern = pattern.strip()
        if name == pattern or name.startswith(pattern.rstrip("*").rstrip(".") + "."):
            return True
    return False


def check_allow(allow: Sequence[str], known: set[str]) -> str | None:
    """A message for the first `--allow` entry that names no fact of any run, else None."""
    for pattern in allow:
        if any(is_allowed(name, [pattern]) for name in known):
            continue
        close = difflib.get_close_matches(pattern, sorted(known), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        return (f"--allow {pattern} names no field these runs record.{hint} Use the names the "
                "differences are listed under (e.g. optimizer.lr), or a section (optimizer).")
    return None


def group_key(facts: dict[str, Any], where: str = "") -> tuple[tuple[str, str], ...]:
    """What decides a run's side: every spec fact but the seed and ignored ones. What the run
    recorded (code, environment and hardware from the manifest, tokens from its events) is left
    out, so seeds run at another commit still form one side; such a fact is then reported as a
    difference within that side. A run without a spec (`where`: its directory) is a side of its
    own: nothing says it is the same job as another."""
    key = tuple(sorted((k, repr(v)) for k, v in facts.items()
                       if kind_of(k) not in (SEED, IGNORED) and not k.startswith(RECORDED)))
    return key if "run.seed" in facts else (("run.dir", where), *key)
