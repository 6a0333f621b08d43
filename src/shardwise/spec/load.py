"""Load a RunSpec from TOML plus `--set section.key=value` overrides, and write it back.

Values are type-checked against the dataclass annotations here, once, so that the rest of the code
reads typed attributes and never string keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.model import ModelSection, default_of, fields_class, owner_of
from shardwise.spec.runspec import RunSpec
from shardwise.spec.toml import build_table, read_toml, shown_name, suggest, toml_value

_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunSpec)[f.name] for f in dataclasses.fields(RunSpec)
}
#: sections renamed since a release wrote them into run directories' spec.toml: read under the
#: new name, so an old run still resumes (both spellings at once is a mistake worth naming)
RENAMED_SECTIONS = {"plan": "fit"}
MODEL_KEYS = "see docs/runspec.md#model"


def load_spec(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunSpec:
    """Defaults, then the TOML file (if any), then each override in order; validated."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        data = read_toml(Path(path))
    overrides = list(overrides)
    for item in overrides:
        section, key, value = parse_override(item)
        _set(data, section, key, value, item, path)
    origin = " or ".join(([str(path)] if path else []) + (["--set"] if overrides else []))
    return spec_from_dict(data, origin=origin or "the spec").validate()


def spec_from_dict(data: Mapping[str, Any], origin: str = "the spec") -> RunSpec:
    """Build a RunSpec from nested mappings, rejecting unknown keys and wrong types."""
    data = _renamed(data, origin)
    check_tables(data, _SECTIONS, origin)
    sections: dict[str, Any] = {
        name: (model_section(values, origin) if name == "model"
               else build_table(name, _SECTIONS[name], values, origin))
        for name, values in data.items()}
    return RunSpec(**sections)


def model_section(table: Mapping[str, Any], origin: str = "the spec") -> ModelSection:
    """The flat [model] table: `family` and `init` first, then the keys that family owns
    (`spec.model.FAMILY_FIELDS`). A key another family owns is an error naming that family,
    unless it holds that family's default: spec.toml files written before families owned their
    fields list every key of every family, and those still load."""
    table = dict(table)
    head = build_table("model", ModelSection, {k: table.pop(k) for k in ("family", "init")
                                               if k in table}, origin)
    cls = fields_class(head.family)
    own = [f.name for f in dataclasses.fields(cls)]
    keys = ", ".join(["family", "init", *own])
    mine = {}
    for key, value in table.items():
        if key in own:
            mine[key] = value
            continue
        owner = owner_of(key)
        if owner is None:
            raise SpecError(f"unknown key model.{shown_name(key)} in {origin}."
                            f"{suggest(key, own)} Keys of family {head.family!r}: {keys}.")
        if value == default_of(key):
            continue
        raise SpecError(
            f"model.{shown_name(key)} in {origin} belongs to model.family = {owner!r}, but "
            f"this model's family is {head.family!r}. Set model.family = {owner!r}, or remove "
            f"model.{shown_name(key)}. Keys of family {head.family!r}: {keys}.")
    return ModelSection(head.family, head.init, build_table("model", cls, mine, origin))


def _renamed(data: Mapping[str, Any], origin: str) -> Mapping[str, Any]:
    """`data` with every old section name read as its new one."""
    if not any(old in data for old in RENAMED_SECTIONS):
        return data
    out = dict(data)
    for old, new in RENAMED_SECTIONS.items():
        if old in out:
            if new in out:
                raise SpecError(f"{origin} sets both [{old}] and [{new}]; [{old}] is the old name "
                                f"of [{new}]. Move its keys into [{new}] and remove [{old}].")
            out[new] = out.pop(old)
    return out


def check_tables(data: Mapping[str, Any], sections: Iterable[str], origin: str) -> None:
    """Every top-level key of `data` is a known section holding a table."""
    known = list(sections)
    for name, values in data.items():
        if name not in known:
            raise SpecError(f"unknown section [{shown_name(name)}] in {origin}."
                            f"{suggest(name, known)} Valid sections: {', '.join(known)}.")
        if not isinstance(values, Mapping):
            raise SpecError(f"[{name}] in {origin} must be a table of keys, got {show(values)}.")


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value`; the value is read as TOML, falling back to a bare string."""
    dotted, equals, raw = item.partition("=")
    section, _, key = dotted.partition(".")
    section, key = section.strip(), key.strip()
    if not equals or not section or not key:
        raise SpecError(
            f"--set {show(item)} is not of the form section.key=value, for example "
            "--set optimizer.lr=1e-3 or --set data.source=/path/to/text.txt."
        )
    if "." in key:  # sections are flat: there is no [run.x] table for `run.x.y` to go into
        raise SpecError(
            f"--set {show(item)} names the key {shown_name(dotted.strip())}, with more than one dot; "
            "every field is section.key with one dot (e.g. --set optimizer.lr=1e-3). "
            f"{_keys_of(section)}"
        )
    return section, key, _override_value(raw.strip())


def _override_value(raw: str) -> Any:
    """The TOML value `raw` spells, else `raw` itself: `--set data.source=/x/y.txt` needs no
    quotes. Text that parses to more than one value (`1\nx = 2`) is not a value: a string."""
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except (tomllib.TOMLDecodeError, RecursionError):
        return raw
    return parsed["v"] if list(parsed) == ["v"] else raw


def _set(data: dict[str, Any], section: str, key: str, value: Any, item: str,
         path: str | Path | None) -> None:
    """Put one override into the document read from `path`, whose [section] must be a table."""
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise SpecError(f"--set {show(item)} cannot go into [{shown_name(section)}]: {path} sets "
                        f"{shown_name(section)} = {show(table)}, which is not a table of keys. Make it "
                        f"a [{shown_name(section)}] table in {path}.")
    table[key] = value


def _keys_of(section: str) -> str:
    cls = _SECTIONS.get(section)
    if cls is None:
        return f"There is no section [{shown_name(section)}].{suggest(section, _SECTIONS)}"
    if cls is ModelSection:
        return f"Valid keys of [model]: family, init and the family's own ({MODEL_KEYS})."
    return f"Valid keys of [{section}]: {', '.join(f.name for f in dataclasses.fields(cls))}."


def spec_to_toml(spec: RunSpec) -> str:
    """The resolved spec as TOML that `load_spec` reads back to an equal spec."""
    lines: list[str] = []
    for section, values in spec.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


