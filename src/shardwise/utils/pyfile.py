"""Import a function a spec names as `py:FILE.py:FUNCTION` (a model builder, a dataset).

Paths are relative to the directory shardwise runs in. Every failure is a UserError that names
the spec field, so a typo in a path or a crash in the user's file reads as theirs, not ours.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardwise.errors import UserError, brief


def split_py(value: str, field: str, example: str) -> tuple[Path, str]:
    """(resolved file, function name) of `py:FILE:FUNCTION`; `field` names the spec key."""
    body = value[len("py:"):]
    path, sep, function = body.rpartition(":")
    if not sep or not path or not function:
        raise UserError(f"{field} = {value!r} is not of the form \"py:FILE:FUNCTION\", e.g. "
                        f"\"{example}\".")
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{field} = {value!r}: {file} does not exist (paths are relative to the "
                        "directory you run shardwise in). Give the path of a .py file.")
    return file.resolve(), function


def import_file(path: Path, value: str, field: str) -> Any:
    """The module of `path`, imported once per process under a name derived from its path."""
    name = "shardwise_user_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{field} = {value!r}: {path} cannot be imported as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the user's file: report any failure as theirs, with its cause
        del sys.modules[name]
        raise UserError(f"{field} = {value!r}: importing {path} failed with "
                        f"{type(err).__name__}: {err}.") from None
    return module


def load_function(value: str, field: str, example: str, signature: str) -> Callable[..., Any]:
    """The function `py:FILE:FUNCTION` names; `signature` is what the message says it takes."""
    path, function = split_py(value, field, example)
    found = getattr(import_file(path, value, field), function, None)
    if not callable(found):
        raise UserError(f"{field} = {value!r}: {path} defines no function {function!r}. Name a "
                        f"function {signature} in that file.")
    return found


def file_sha256(value: str, field: str, example: str) -> dict[str, str]:
    """What pins user code for the manifest: the file's path and SHA-256."""
    path, _ = split_py(value, field, example)
    return {"file": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def failure_text(err: BaseException, function: Callable[..., Any] | None) -> str:
    """"RuntimeError: its message (at FILE:LINE, in NAME)": what user code raised, short enough
    for one paragraph, and the last line of `function`'s own file the error passed through, so
    the message points at the line to change."""
    return f"{brief(err)}{_site(err, function)}"


def _site(err: BaseException, function: Callable[..., Any] | None) -> str:
    try:
        own = Path(inspect.getfile(function)).resolve()  # type: ignore[arg-type]
    except (TypeError, OSError):
        return ""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if Path(f.filename).resolve() == own]
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno}, in {last.name})"
