"""Load a RunSpec from TOML plus `--set section.key=value` overrides, and write it back.

Values are type-checked against the dataclass annotations here, once, so that the rest of the code
reads typed attributes and never string keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError
from shardwise.spec.runspec import RunSpec

_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunSpec)[f.name] for f in dataclasses.fields(RunSpec)
}


def load_spec(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunSpec:
    """Defaults, then the TOML file (if any), then each override in order; validated."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        data = _read_toml(Path(path))
    overrides = list(overrides)
    for item in overrides:
        section, key, value = parse_override(item)
        data.setdefault(section, {})[key] = value
    origin = " or ".join(([str(path)] if path else []) + (["--set"] if overrides else []))
    return spec_from_dict(data, origin=origin or "the spec").validate()


def spec_from_dict(data: Mapping[str, Any], origin: str = "the spec") -> RunSpec:
    """Build a RunSpec from nested mappings, rejecting unknown keys and wrong types."""
    sections: dict[str, Any] = {}
    for name, values in data.items():
        if name not in _SECTIONS:
            raise SpecError(f"unknown section [{name}] in {origin}.{_suggest(name, _SECTIONS)} "
                            f"Valid sections: {', '.join(_SECTIONS)}.")
        if not isinstance(values, Mapping):
            raise SpecError(f"[{name}] in {origin} must be a table of keys, got {values!r}.")
        sections[name] = _build_section(name, _SECTIONS[name], values, origin)
    return RunSpec(**sections)


def parse_override(item: str) -> tuple[str, str, Any]:
    """`section.key=value`; the value is read as TOML, falling back to a bare string."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise SpecError(
            f"--set {item!r} is not of the form section.key=value, for example "
            "--set optimizer.lr=1e-3 or --set data.source=/path/to/text.txt."
        )
    dotted, raw = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SpecError(f"config file {path} does not exist. Pass an existing .toml file, or no "
                        "file at all to train the embedded default (see examples/).")
    if path.is_dir():
        raise SpecError(f"config path {path} is a directory; pass a .toml file. To continue a "
                        f"run, use `shardwise train --resume {path}`.")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path} is not valid TOML: {err}. Fix the line it names.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"cannot read config file {path}: {err}.") from None


def _build_section(name: str, cls: type, values: Mapping[str, Any], origin: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise SpecError(
                f"unknown key {name}.{key} in {origin}.{_suggest(key, fields)} Valid keys of "
                f"[{name}]: {', '.join(fields)}."
            )
        kwargs[key] = _coerce(f"{name}.{key}", hints[key], value)
    return cls(**kwargs)


def _coerce(where: str, expected: Any, value: Any) -> Any:
    if expected is bool:
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - every field has one of the types above
        raise TypeError(f"unsupported field type {expected} for {where}")
    example = {bool: "true or false", int: "a whole number like 4", float: "a number like 3e-4",
               str: 'a string like "iambic"'}[expected]
    raise SpecError(f"{where} must be {example}, got {value!r} ({type(value).__name__}).")


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def spec_to_toml(spec: RunSpec) -> str:
    """The resolved spec as TOML that `load_spec` reads back to an equal spec."""
    lines: list[str] = []
    for section, values in spec.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string, except that TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"cannot write {value!r} as TOML")
