"""Load a RunSpec from TOML plus `--set section.key=value` overrides, and write it back.

Values are type-checked against the dataclass annotations here, once, so that the rest of the code
reads typed attributes and never string keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.spec.runspec import RunSpec

_SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunSpec)[f.name] for f in dataclasses.fields(RunSpec)
}
INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # every int field ends up in a C int64 (seeds, sizes, steps)
#: sections renamed since a release wrote them into run directories' spec.toml: read under the
#: new name, so an old run still resumes (both spellings at once is a mistake worth naming)
RENAMED_SECTIONS = {"plan": "fit"}


def load_spec(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunSpec:
    """Defaults, then the TOML file (if any), then each override in order; validated."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        data = _read_toml(Path(path))
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
    return RunSpec(**{name: _build_section(name, _SECTIONS[name], values, origin)
                      for name, values in data.items()})


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
            raise SpecError(f"unknown section [{_name(name)}] in {origin}."
                            f"{_suggest(name, known)} Valid sections: {', '.join(known)}.")
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
            f"--set {show(item)} names the key {_name(dotted.strip())}, with more than one dot; "
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
        raise SpecError(f"--set {show(item)} cannot go into [{_name(section)}]: {path} sets "
                        f"{_name(section)} = {show(table)}, which is not a table of keys. Make it "
                        f"a [{_name(section)}] table in {path}.")
    table[key] = value


def _read_toml(path: Path) -> dict[str, Any]:
    if "\x00" in str(path):
        raise SpecError(f"config path {show(str(path))} contains a NUL character; pass the path "
                        "of a .toml file.")
    if not path.exists():
        raise SpecError(f"config file {path} does not exist. Pass an existing .toml file, or no "
                        "file at all to train the embedded default (see examples/).")
    if path.is_dir():
        raise SpecError(f"config path {path} is a directory; pass a .toml file. To continue a "
                        f"run, use `shardwise train --resume {path}`.")
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(f"cannot read config file {path}: {err}.") from None
    try:
        text = raw.decode("utf-8")  # TOML is UTF-8 whatever the locale says
    except UnicodeDecodeError as err:
        raise SpecError(f"{path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                        f"{err.start}); TOML files must be UTF-8. Re-save the file as UTF-8.") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"{path} is not valid TOML: {err}. Fix the line it names.") from None
    except RecursionError:
        raise SpecError(f"{path} nests arrays or tables too deeply to read; a RunSpec has only "
                        "[section] tables of plain values.") from None


def _build_section(name: str, cls: type, values: Mapping[str, Any], origin: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise SpecError(
                f"unknown key {name}.{_name(key)} in {origin}.{_suggest(key, fields)} Valid keys "
                f"of [{name}]: {', '.join(fields)}."
            )
        kwargs[key] = _coerce(f"{name}.{key}", hints[key], value)
    return cls(**kwargs)


def _coerce(where: str, expected: Any, value: Any) -> Any:
    if isinstance(expected, types.UnionType):  # str | dict: a file path or an inline table
        if isinstance(value, str):
            return _checked_str(where, value)
        if isinstance(value, dict):
            return _checked_table(where, value)
        raise SpecError(f"{where} must be a file path (a string) or a table like "
                        f"{{ model_type = \"llama\", hidden_size = 64 }}, got {show(value)} "
                        f"({type(value).__name__}).")
    if typing.get_origin(expected) is tuple and typing.get_args(expected)[0] is str:
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(_checked_str(f"{where}[{i}]", v) for i, v in enumerate(value))
        raise SpecError(f"{where} must be an array of strings like [\"py:my_hooks.py:setup\"], "
                        f"got {show(value)} ({type(value).__name__}).")
    if typing.get_origin(expected) is tuple:  # tuple[int, ...]: an array of whole numbers
        if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return tuple(_checked_int(f"{where}[{i}]", v) for i, v in enumerate(value))
        raise SpecError(f"{where} must be an array of whole numbers like [3, 4, 4, 3], got "
                        f"{show(value)} ({type(value).__name__}).")
    if typing.get_origin(expected) is dict:
        if isinstance(value, dict):
            return _checked_table(where, value)
        raise SpecError(f"{where} must be a table of keyword arguments like "
                        f"{{ hidden = 64, layers = 2 }}, got {show(value)} "
                        f"({type(value).__name__}).")
    if expected is bool:
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return _checked_int(where, value)
    elif expected is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return _checked_float(where, value)
    elif expected is str:
        if isinstance(value, str):
            return _checked_str(where, value)
    else:  # pragma: no cover - every field has one of the types above
        raise TypeError(f"unsupported field type {expected} for {where}")
    example = {bool: "true or false", int: "a whole number like 4", float: "a number like 3e-4",
               str: 'a string like "iambic"'}[expected]
    raise SpecError(f"{where} must be {example}, got {show(value)} ({type(value).__name__}).")


def _checked_table(where: str, table: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for user code: TOML's plain values (strings, numbers, booleans) and
    arrays and tables of them; dates and times are not arguments anything here takes."""
    return {_checked_str(f"{where} key", key): _checked_value(f"{where}.{_name(key)}", value)
            for key, value in table.items()}


def _checked_value(where: str, value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return _checked_int(where, value)
    if isinstance(value, float):
        return _checked_float(where, value)
    if isinstance(value, str):
        return _checked_str(where, value)
    if isinstance(value, list):
        return [_checked_value(f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return _checked_table(where, value)
    raise SpecError(f"{where} = {show(value)} is a {type(value).__name__}; arguments may be "
                    "strings, numbers, booleans, and arrays or tables of them.")


def _checked_int(where: str, value: int) -> int:
    if not INT_MIN <= value <= INT_MAX:
        raise SpecError(f"{where} = {show(value, 40)} does not fit in 64 bits; no count, size or "
                        "seed needs that much. Use a value between -2**63 and 2**63 - 1.")
    return value


def _checked_float(where: str, value: float) -> float:
    """A float field holds a finite number: nan or inf never means something here (0 switches off
    what can be switched off), and an int beyond the float range is not a number either."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise SpecError(f"{where} must be a finite number, got {show(value, 40)}. Write a plain "
                        "number like 3e-4.")
    return number


def _checked_str(where: str, value: str) -> str:
    """Strings end up in paths, file names and a UTF-8 spec.toml: no NUL, nothing unencodable."""
    if "\x00" in value:
        raise SpecError(f"{where} = {show(value)} contains a NUL character; remove it.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise SpecError(f"{where} = {show(value)} is not valid UTF-8 text (a command line with "
                        "bytes that are not UTF-8 gives this); write it in UTF-8.") from None
    return value


def _name(text: str) -> str:
    """A section or key name as the user wrote it, quoted when it holds anything unprintable."""
    return text if text.isprintable() and len(text) <= 40 else show(text, 40)


def _keys_of(section: str) -> str:
    cls = _SECTIONS.get(section)
    if cls is None:
        return f"There is no section [{_name(section)}].{_suggest(section, _SECTIONS)}"
    return f"Valid keys of [{section}]: {', '.join(f.name for f in dataclasses.fields(cls))}."


def _suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word[:100], list(choices), n=1, cutoff=0.6)
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
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
