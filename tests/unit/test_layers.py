"""The package's import structure: layers point down, no cycles, private torch names in one place.

Every import counts, also those inside functions (a lazy import is one tidy-up away from a real
circular import); only `if TYPE_CHECKING:` blocks are left out. The layers, top to bottom, are
those of docs/internals.md: a package may import its own layer and the ones below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

#: top to bottom; a name is a subpackage or a top-level module of shardwise ("" is the facade,
#: shardwise/__init__.py, which reaches shardwise.api lazily)
LAYERS: list[set[str]] = [
    {"cli", "__main__"},
    {"verify", "cluster", "study"},
    {"", "api"},
    {"run"},
    {"checkpoint"},
    {"parallel"},
    {"models"},
    {"data"},
    {"resilience"},
    {"planner", "report", "compare"},
    {"telemetry"},
    {"spec"},
    {"errors", "meta", "compat", "utils", "shape"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "shardwise").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, int]]:
    """The shardwise modules `name` imports (outside TYPE_CHECKING), with line numbers."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("shardwise") and target != name:
                out.append((target, node.lineno))
    return out


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    assert {_layer(m) for m in MODULES} <= set(RANK), \
        f"add these to LAYERS (and docs/internals.md): {sorted({_layer(m) for m in MODULES} - set(RANK))}"


def test_imports_point_down_the_layers():
    upward = [f"{MODULES[a].relative_to(SRC)}:{line} imports {b} ({_layer(a) or 'shardwise'} is "
              f"below {_layer(b) or 'shardwise'})"
              for a, targets in GRAPH.items() for b, line in targets
              if RANK[_layer(b)] < RANK[_layer(a)]]
    assert not upward, "\n".join(upward)


def test_no_import_cycle_between_files():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _private_torch_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if any(p.startswith("_") for p in (node.module or "").split(".")) or private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import "
                             f"{', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and ast.unparse(node.value) in ("torch", "torch._C"):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_private_torch_names_only_in_compat():
    uses = [use for name, path in MODULES.items() if name != "shardwise.compat"
            for use in _private_torch_uses(path)]
    assert not uses, ("import these from shardwise.compat (add them there, with why):\n"
                      + "\n".join(uses))


def test_compat_names_exist_on_this_torch():
    """Each private symbol resolves on the installed torch (CI: 2.13; the GPU machine: 2.11)."""
    import shardwise.compat as compat

    for name in compat.__all__:
        assert getattr(compat, name) is not None, name
    compat.functional_collectives()
    assert compat.in_autograd_thread() is False
    compat.clear_dtensor_caches()
    try:
        import fsspec  # noqa: F401
    except ImportError:
        pytest.skip("fsspec is not installed: the object-storage reader/writer are not checked")
    assert compat.fsspec_reader().__name__ == "FsspecReader"
    assert compat.fsspec_writer().__name__ == "FsspecWriter"
