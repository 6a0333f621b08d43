"""docs/runspec.md is what `python -m shardwise.spec.reference` generates from the code, and it
documents every field of every section."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from shardwise.spec import reference
from shardwise.spec.cluster import ClusterSpec
from shardwise.spec.failure import Fault
from shardwise.spec.field_notes import FIELD_NOTES
from shardwise.spec.model import FAMILY_FIELDS, BuilderFields, ModelSection
from shardwise.spec.runspec import RunSpec
from shardwise.spec.training import PRECISIONS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "runspec.md"


def test_runspec_md_matches_the_code():
    assert DOC.read_text(encoding="utf-8") == reference.render(), (
        "docs/runspec.md differs from the RunSpec in the code; regenerate it with "
        f"`{reference.REGENERATE}` (PYTHONPATH=src without an installed shardwise)")


def _rows_by_table(text: str) -> dict[str, set[str]]:
    """heading -> the keys of its table's rows."""
    rows: dict[str, set[str]] = {}
    heading = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
            rows.setdefault(heading, set())
        match = re.match(r"^\| `([^`]+)` \|", line)
        if match:
            rows[heading].add(match[1])
    return rows


@pytest.mark.parametrize("spec_cls", [RunSpec, ClusterSpec])
def test_every_field_of_every_section_appears(spec_cls):
    rows = _rows_by_table(DOC.read_text(encoding="utf-8"))
    hints = typing.get_type_hints(spec_cls)
    missing = []
    for section in dataclasses.fields(spec_cls):
        heading = f"`[{section.name}]`"
        if heading not in rows:
            missing.append(f"no heading {heading}")
            continue
        documented = set(rows[heading])
        if hints[section.name] is ModelSection:  # [model]'s head, then each family's keys
            documented |= {key for title, keys in rows.items()
                           if title.startswith("`[model]`, family") for key in keys}
            fields = [f for f in dataclasses.fields(ModelSection) if f.name != "fields"]
            fields += [f for cls in (*FAMILY_FIELDS.values(), BuilderFields)
                       for f in dataclasses.fields(cls)]
        else:
            fields = list(dataclasses.fields(hints[section.name]))
        missing += [f"{section.name}.{f.name}" for f in fields if f.name not in documented]
    assert not missing, f"docs/runspec.md lacks {missing}; run `{reference.REGENERATE}`"


def test_every_fault_key_appears():
    rows = _rows_by_table(DOC.read_text(encoding="utf-8"))["`failure.faults`"]
    assert {f.name for f in dataclasses.fields(Fault)} - {"kind"} <= rows


def test_every_field_is_described():
    """A new field needs a comment next to it in the source (or a line in FIELD_NOTES)."""
    assert reference.missing_docs() == [], (
        "these fields have no description: add a comment next to each field in the source "
        "(or a line in shardwise.spec.field_notes.FIELD_NOTES), then regenerate docs/runspec.md")


def test_field_notes_name_real_fields():
    stale = set(FIELD_NOTES) - reference.note_keys()
    assert not stale, f"FIELD_NOTES describes fields that do not exist: {sorted(stale)}"


def test_values_come_from_validate():
    run = {k.name: k for k in reference.run_tables()[0].keys}
    assert run["precision"].values == ", ".join(f"`{p}`" for p in PRECISIONS)
    assert run["steps"].values == "> 0" and run["seed"].values == "≥ 0"
    parallel = {k.name: k for t in reference.run_tables() if t.name == "parallel" for k in t.keys}
    assert parallel["tp"].values == "> 0"  # from the loop over names in validate()
    assert parallel["dp_shard"].values == ""  # checked only when it is not -1: not claimed


def test_defaults_and_types_are_the_dataclasses():
    tables: dict[str, dict] = {}
    for t in reference.run_tables():  # [model] is several tables: its head and each family's
        tables.setdefault(t.name, {}).update({k.name: k for k in t.keys})
    assert tables["run"]["steps"].default == str(RunSpec().run.steps)
    assert tables["parallel"]["pp_layer_split"].type == "array of integers"
    assert tables["model"]["hf_config"].type == "string or table"
    assert tables["checkpoint"]["uri"].default == '""'


def test_check_exits_1_with_one_line_when_stale(tmp_path, capsys):
    assert reference.main(["--check", str(DOC)]) == 0
    stale = tmp_path / "runspec.md"
    stale.write_text(reference.render().replace("| `steps` |", "| `stepz` |"))
    assert reference.main(["--check", str(stale)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "python -m shardwise.spec.reference >" in err[0]
    assert reference.main(["--check", str(tmp_path / "missing.md")]) == 1


def test_the_module_imports_no_torch():
    code = ("import sys, shardwise.spec.reference as r; r.render(); "
            "sys.exit('torch' in sys.modules)")
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": ""}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_the_composition_table_is_the_codes():
    """docs/layouts.md's table of which layouts compose is what the checks say (#24)."""
    from shardwise.verify import matrix

    assert not matrix.stale(DOC.parent / "layouts.md"), (
        "docs/layouts.md's composition table is stale: paste `python -m shardwise.verify.matrix`")
    assert not matrix.stale(DOC.parent.parent / "README.md", compact=True), (
        "README.md's composition marks are stale: paste `python -m shardwise.verify.matrix "
        "--compact`")
