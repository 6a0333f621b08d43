"""A small TOML toolkit for typed, frozen sections: read a file with messages that say how to fix
it, build a dataclass from a table (unknown keys with a "did you mean", values type-checked against
the annotations), and write values back. The RunSpec (`spec.load`), the cluster file
(`spec.cluster`) and the planner's files all read TOML through it. Imports no torch."""

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

INT_MIN, INT_MAX = -(2**63), 2**63 - 1  # every int field ends up in a C int64 (seeds, sizes, steps)


def read_toml(path: Path) -> dict[str, Any]:
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


def build_table(name: str, cls: type, values: Mapping[str, Any], origin: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise SpecError(
                f"unknown key {name}.{shown_name(key)} in {origin}.{suggest(key, fields)} Valid keys "
                f"of [{name}]: {', '.join(fields)}."
            )
        kwargs[key] = coerce(f"{name}.{key}", hints[key], value)
    return cls(**kwargs)


def coerce(where: str, expected: Any, value: Any) -> Any:
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
    return {_checked_str(f"{where} key", key): _checked_value(f"{where}.{shown_name(key)}", value)
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


def shown_name(text: str) -> str:
    """A section or key name as the user wrote it, quoted when it holds anything unprintable."""
    return text if text.isprintable() and len(text) <= 40 else show(text, 40)


def suggest(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word[:100], list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        # A JSON string is a valid TOML basic string, except that TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(str(k))} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
