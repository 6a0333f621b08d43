"""The RunSpec reference, generated from the code: every section of the RunSpec (and of the
cluster file `shardwise plan --cluster FILE` reads), every key with its TOML type, default,
accepted values and description — `docs/runspec.md`.

    python -m shardwise.spec.reference > docs/runspec.md          # regenerate
    python -m shardwise.spec.reference --check docs/runspec.md    # exit 1 when it is stale

Where each part comes from:
- sections, keys, types and defaults: the dataclasses (`dataclasses.fields`, their type hints);
- descriptions: the source of the module that defines a section, read with `ast` and `tokenize`
  (`source_reader.py`): the comment lines right above a field and the comment after it on its
  line, and the section's docstring. A field the source leaves uncommented gets its line from
  `FIELD_NOTES` (`field_notes.py`; `tests/unit/test_docs_reference.py` fails when a field has
  neither, and when a note names a field that no longer exists), so the source stays the first
  place to document a field;
- accepted values and bounds: each section's `validate()` and `_validate_*()` methods, from their
  unconditional `_choice`, `_positive` and `_at_least` calls (checks made only in some cases are
  left to the description; `source_reader.py` again).

Imports no torch: only the spec layer and the standard library.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.spec import cluster, failure, model, runspec
from shardwise.spec.field_notes import FIELD_NOTES
from shardwise.spec.source_reader import _join, _Source
from shardwise.spec.toml import toml_value as _toml_value

REGENERATE = "python -m shardwise.spec.reference > docs/runspec.md"
CHECK = "python -m shardwise.spec.reference --check docs/runspec.md"


@dataclass(frozen=True)
class Key:
    """One documented field: where it is, what it is."""

    table: str  # the TOML table it sits in
    name: str
    type: str
    default: str  # TOML, or "" when the field is required
    values: str  # accepted values / bounds read from validate(), "" if none
    doc: str


@dataclass(frozen=True)
class Table:
    name: str  # as written in TOML: "run", "peak_tflops", ...
    doc: str
    keys: tuple[Key, ...]
    title: str = ""  # the heading, when not just `[name]` (a model family's keys)


def run_tables() -> list[Table]:
    """Every section of the RunSpec, in the order of `RunSpec`'s fields; [model] as its head
    (family, init) followed by one table per family of the keys that family owns."""
    tables = []
    for f, cls in _sections(runspec.RunSpec):
        if cls is model.ModelSection:
            tables += model_tables()
        else:
            tables.append(_table(f.name, cls, f.name))
    return tables


def model_tables() -> list[Table]:
    """[model]'s own keys, then each family's (a family built on another lists only the keys
    it adds; `spec/model.py` is the registry)."""
    head = _table("model", model.ModelSection, "model", skip={"fields"})
    tables = [head]
    for family, cls in _families():
        base = {f.name for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)
                for f in dataclasses.fields(b)}
        tables.append(_table("model", cls, "model", skip=base,
                             title=f"`[model]`, family {family}"))
    return tables


def _families() -> list[tuple[str, type]]:
    return [*((f"`{name}`", cls) for name, cls in model.FAMILY_FIELDS.items()),
            ("`py:FILE.py:FUNCTION` or a registered name", model.BuilderFields)]


def cluster_tables() -> list[Table]:
    """Every section of a cluster file (`shardwise.spec.cluster.ClusterSpec`)."""
    tables = []
    for f, cls in _sections(cluster.ClusterSpec):
        note_prefix = "link" if cls is cluster.LinkSection else f.name
        tables.append(_table(f.name, cls, note_prefix))
    return tables


def fault_keys() -> list[Key]:
    """The keys of one `failure.faults` entry (`shardwise.spec.failure.Fault`)."""
    return list(_table("fault", failure.Fault, "fault").keys)


def missing_docs() -> list[str]:
    """`section.key` of every field that neither the source nor `FIELD_NOTES` describes."""
    return [f"{t.name}.{k.name}" for t in (*run_tables(), *cluster_tables())
            for k in t.keys if not k.doc] + \
        [f"fault.{k.name}" for k in fault_keys() if not k.doc]


def note_keys() -> set[str]:
    """The `section.key` names `FIELD_NOTES` may use: every documented field."""
    return {f"{prefix}.{f.name}" for prefix, cls in _note_classes()
            for f in dataclasses.fields(cls)}


def render() -> str:
    """docs/runspec.md."""
    out = [
        f"<!-- Generated from the code by `{REGENERATE}`; do not edit by hand. "
        f"`{CHECK}` (and tests/unit/test_docs_reference.py) fails when it is stale. -->",
        "",
        "# RunSpec reference",
        "",
        "Every key of the RunSpec, the TOML file `shardwise train`, `verify` and `launch` read. "
        "One table per section; every key has a default, so a file sets only what differs. "
        "`--set section.key=value` overrides any key (the value is read as TOML: "
        "`--set run.steps=200`, `--set 'model.args={width = 128}'`), and "
        "`shardwise train --print-spec` prints the resolved spec. An unknown section or key, or a "
        "value of the wrong type, exits 2 naming it (with a \"did you mean\"). The *values* column "
        "lists what `validate()` checks for every run; checks that depend on other keys, the layout "
        "or the world size are in the descriptions and in the topic guides "
        "([docs/README.md](README.md)).",
        "",
        "```toml",
        "[run]",
        "steps = 200",
        "",
        "[parallel]",
        "dp_shard = 2",
        "tp = 2",
        "```",
        "",
        "Types are TOML's: a `table` key takes an inline table (`args = { width = 256 }`) of "
        "strings, numbers, booleans, and arrays and tables of them, passed to your code as it is.",
        "",
        "Sections: " + ", ".join(f"[`[{t.name}]`](#{_slug(t.name)})" for t in run_tables()
                                 if not t.title) + ".",
        "",
    ]
    for table in run_tables():
        out += _render_table(table)
        if table.name == "failure":
            out += _render_faults()
    out += [
        "## The cluster file (`shardwise plan --cluster FILE`)",
        "",
        "The machines a run is planned for, read like a RunSpec (unknown keys and wrong types exit "
        "2). `[cluster] base = \"PRESET\"` starts from one of `shardwise plan`'s cluster presets "
        "and changes only what differs; without a base, every key marked *required* must be "
        "given. See [planning.md](planning.md).",
        "",
    ]
    for table in cluster_tables():
        out += _render_table(table, level="###")
    return "\n".join(out).rstrip("\n") + "\n"


# --- the dataclasses -------------------------------------------------------------------------


def _sections(spec_cls: type) -> Iterator[tuple[dataclasses.Field[Any], type]]:
    hints = typing.get_type_hints(spec_cls)
    for f in dataclasses.fields(spec_cls):
        yield f, hints[f.name]


def _note_classes() -> Iterator[tuple[str, type]]:
    for f, cls in _sections(runspec.RunSpec):
        yield f.name, cls
    for _, cls in _families():
        yield "model", cls
    for f, cls in _sections(cluster.ClusterSpec):
        yield ("link" if cls is cluster.LinkSection else f.name), cls
    yield "fault", failure.Fault


def _table(name: str, cls: type, note_prefix: str, skip: set[str] | frozenset[str] = frozenset(),
           title: str = "") -> Table:
    source = _Source.of(cls)
    hints = typing.get_type_hints(cls)
    checks = source.checks(cls.__name__)
    keys = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        doc = _join([source.comment(cls.__name__, f.name),
                     FIELD_NOTES.get(f"{note_prefix}.{f.name}", "")])
        keys.append(Key(name, f.name, _toml_type(hints[f.name]), _default(f),
                        checks.get(f.name, ""), doc))
    return Table(name, _docstring(cls), tuple(keys), title)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "unset"
    return _toml_value(value)


def _toml_type(hint: Any) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = [_toml_type(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(parts)
    origin = typing.get_origin(hint)
    if origin is dict:
        return "table"
    if origin in (tuple, list):
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return f"array of {_toml_type(args[0])}s" if args else "array"
    return {bool: "boolean", int: "integer", float: "float", str: "string"}.get(hint, str(hint))


def _docstring(cls: type) -> str:
    text = inspect.getdoc(cls) or ""
    if text.startswith(f"{cls.__name__}(") or not text:  # dataclass's generated signature
        return ""
    return " ".join(text.split())


# --- Markdown --------------------------------------------------------------------------------


def _render_table(table: Table, level: str = "##") -> list[str]:
    # a title is a part of the section before it: one level down
    out = [f"{level}# {table.title}", ""] if table.title else [f"{level} `[{table.name}]`", ""]
    if table.doc:
        out += [_md(table.doc), ""]
    out += ["| key | type | default | values | description |", "|---|---|---|---|---|"]
    for k in table.keys:
        default = f"`{k.default}`" if k.default else "*required*"
        out.append(f"| `{k.name}` | {k.type} | {_cell(default)} | {_cell(k.values)} | "
                   f"{_cell(_md(k.doc))} |")
    out.append("")
    return out


def _render_faults() -> list[str]:
    out = [
        "### `failure.faults`",
        "",
        "Faults injected for drills and tests (also from `$SHARDWISE_FAULTS`): a `;`-separated "
        "list of `KIND:KEY=VALUE:KEY=VALUE`, e.g. `kill:rank=1:step=3:phase=backward`. Kinds: "
        + ", ".join(f"`{k}`" for k in failure.KINDS) + "; phases: "
        + ", ".join(f"`{p}`" for p in failure.PHASES)
        + ". What each kind does: [checkpoints.md](checkpoints.md#fault-injection).",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
    ]
    for k in fault_keys():
        if k.name == "kind":
            continue
        out.append(f"| `{k.name}` | {k.type} | `{k.default}` | {_cell(_md(k.doc))} |")
    out.append("")
    return out


def _md(text: str) -> str:
    """Source prose as Markdown: `<name>` outside code spans is text, not an HTML tag (inside a
    code span it already is, and an entity there would show as written)."""
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace(">", "&gt;")
                    for i, part in enumerate(parts))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _slug(name: str) -> str:
    """GitHub's anchor of a heading `[name]` in backticks."""
    return re.sub(r"[^\w\- ]", "", name.lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.spec.reference",
        description="Write the RunSpec reference (docs/runspec.md) generated from the code.")
    parser.add_argument("--check", metavar="FILE",
                        help="compare FILE with what would be generated; exit 1 if it differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    current = path.read_text(encoding="utf-8") if path.is_file() else None
    if current != text:
        state = "does not exist" if current is None else "differs from the RunSpec in the code"
        print(f"{path} {state}; regenerate it with `python -m shardwise.spec.reference > {path}`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
