"""What the spec modules' source says about their fields, read with `ast` and `tokenize` for the
reference (`shardwise.spec.reference`): the comment lines right above a field and the comment
after it on its line, and the accepted values and bounds each section's `validate()` and
`_validate_*()` methods check unconditionally (`_choice`, `_positive` and `_at_least` calls; checks
made only in some cases are left to the description).

Imports no torch: only the standard library.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any


class _Source:
    """One module's source: the comments beside each dataclass field, and what each class's
    validation methods check unconditionally."""

    _cache: typing.ClassVar[dict[str, _Source]] = {}

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        text = inspect.getsource(module)
        self.lines = text.splitlines()
        self.tree = ast.parse(text)
        self.comments: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                self.comments[tok.start[0]] = tok.string.lstrip("#").strip()
        self.classes = {node.name: node for node in ast.walk(self.tree)
                        if isinstance(node, ast.ClassDef)}

    @classmethod
    def of(cls, dataclass_type: type) -> _Source:
        module = sys.modules[dataclass_type.__module__]
        if module.__name__ not in cls._cache:
            cls._cache[module.__name__] = cls(module)
        return cls._cache[module.__name__]

    def comment(self, class_name: str, field_name: str) -> str:
        """The comment lines right above the field, then the comment on its own line(s)."""
        for node in self.classes[class_name].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == field_name:
                above: list[str] = []
                line = node.lineno - 1
                while line >= 1 and self.lines[line - 1].strip().startswith("#"):
                    above.insert(0, self.comments.get(line, ""))
                    line -= 1
                after = [self.comments[n] for n in range(node.lineno, (node.end_lineno or
                                                                       node.lineno) + 1)
                         if n in self.comments]
                return _join([" ".join(above), *after])
        return ""

    def checks(self, class_name: str) -> dict[str, str]:
        """field -> accepted values, from the unconditional `choice` / `positive` /
        `at_least` calls (spec.checks) of the class's `validate` and `_validate_*` methods."""
        found: dict[str, list[str]] = {}
        for node in self.classes[class_name].body:
            if isinstance(node, ast.FunctionDef) and (node.name == "validate"
                                                      or node.name.startswith("_validate")):
                for statement in node.body:
                    for name, text in self._statement_checks(statement):
                        if text not in found.setdefault(name, []):
                            found[name].append(text)
        return {name: "; ".join(texts) for name, texts in found.items()}

    def _statement_checks(self, statement: ast.stmt) -> Iterator[tuple[str, str]]:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call):
            yield from self._call_check(statement.value, {})
        elif isinstance(statement, ast.For) and isinstance(statement.target, ast.Name) \
                and isinstance(statement.iter, ast.Tuple | ast.List):
            names = [e.value for e in statement.iter.elts
                     if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            for inner in statement.body:
                if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Call):
                    for name in names:
                        yield from self._call_check(inner.value, {statement.target.id: name})

    def _call_check(self, call: ast.Call, loop: dict[str, str]) -> Iterator[tuple[str, str]]:
        if not isinstance(call.func, ast.Name) or len(call.args) < 2:
            return
        field_name = _field_of(call.args[1], loop)
        if field_name is None:
            return
        check = call.func.id.lstrip("_")  # `positive` (spec.checks), or a module's own alias
        if check == "positive":
            yield field_name, "> 0"
        elif check == "at_least" and len(call.args) >= 3:
            low = self._value(call.args[2])
            if isinstance(low, int | float):
                yield field_name, f"≥ {low:g}"
        elif check == "choice" and len(call.args) >= 3:
            choices = self._value(call.args[2])
            if isinstance(choices, tuple):
                yield field_name, ", ".join(f"`{c}`" for c in choices)

    def _value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Name):
            return getattr(self.module, node.id, None)
        try:
            return ast.literal_eval(node)
        except ValueError:
            return None


def _field_of(node: ast.expr, loop: dict[str, str]) -> str | None:
    """`self.name` -> "name"; `getattr(self, var)` inside a loop over names -> that name."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self":
        return node.attr
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "getattr" and len(node.args) == 2 \
            and isinstance(node.args[1], ast.Name):
        return loop.get(node.args[1].id)
    return None


def _join(parts: list[str]) -> str:
    """Comment pieces as one description: a piece that starts in lower case continues the one
    before it; otherwise the one before it ends a sentence."""
    out = ""
    for part in filter(None, parts):
        if out and not part[0].islower() and out[-1] not in ".;:!?)":
            out += "."
        elif out.endswith(".") and part.split(" ", 1)[0].isalpha() and part[0].islower():
            part = part[0].upper() + part[1:]  # a new sentence
        out = f"{out} {part}" if out else part
    return out
