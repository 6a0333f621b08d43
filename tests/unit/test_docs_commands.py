"""Every command and RunSpec snippet in README.md and docs/*.md is one the code accepts, and every
relative link points at a file that exists.

- Shell commands in ```bash / ```sh / ```console / ```shell blocks (lines starting with
  `shardwise `, `python -m shardwise`, or `$ `; `torchrun ... -m shardwise ...` too; `\\`
  continuations joined) are parsed by the real CLI parser (`shardwise.cli.main.build_parser`):
  an unknown subcommand or flag fails with the file and line. Beyond the parser: every `--set`
  names a real section and key and gives a value of the right type (the spec is loaded, with the
  command's config when it is a file in the repository), `verify --layouts` names are layouts,
  `plan` presets exist, `export --format` is a format, and repository paths exist.
- ```toml blocks that hold RunSpec (or cluster-file) tables are parsed with tomllib; every section
  and key must exist in the dataclasses, and the values must load.
- A code block that needs a cluster or a GPU carries `<!-- needs: cluster -->` or
  `<!-- needs: gpu -->` on the line before it: it is still parsed, never run (nothing here runs a
  command; the e2e tests run the main ones, see tests/README.md). A launch that can only run on a
  cluster (`launch --exec`, `launch --slurm` without `--dry-run`, multi-node torchrun) must be so
  marked.

Also: docs/internals.md's layer table is the `LAYERS` list of tests/unit/test_layers.py.

Each command, snippet and link is its own test id (`FILE:LINE`). Torch is never imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib.util
import io
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardwise.errors import SpecError, UserError
from shardwise.spec import load_spec, parse_override, spec_from_dict
from shardwise.spec.cluster import ClusterSpec, cluster_from_dict
from shardwise.spec.model import FAMILY_FIELDS, BuilderFields, ModelSection
from shardwise.spec.runspec import RunSpec

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "console", "shell"}
NEEDS = {"cluster", "gpu"}
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_NEEDS = re.compile(r"^\s*<!--\s*needs:\s*([\w-]+)\s*-->\s*$")
_ANY_NEEDS = re.compile(r"<!--\s*needs:")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    lines: tuple[tuple[int, str], ...]  # (line number, text) of the content
    needs: str  # "" when not marked


@dataclass(frozen=True)
class Command:
    path: Path
    line: int
    text: str  # as written, continuations joined
    argv: tuple[str, ...]  # after `shardwise` / `python -m shardwise` / `-m shardwise`
    module: str  # `python -m shardwise.X` names X's module instead of argv
    needs: str
    embedded: bool  # inside a torchrun / srun line

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, start = match[2], match[3].lower(), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append((i + 1, lines[i]))
            i += 1
        previous = _NEEDS.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(path, start + 1, lang, tuple(body), previous[1] if previous else ""))
        i += 1
    return blocks


def _logical_lines(block: Block) -> list[tuple[int, str]]:
    """(first line number, text) with `\\` continuations joined."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, text in block.lines:
        if pending is not None:
            number, text = pending[0], pending[1] + " " + text.strip()
        if text.rstrip().endswith("\\"):
            pending = (number, text.rstrip()[:-1])
            continue
        pending = None
        out.append((number, text))
    if pending is not None:
        out.append(pending)
    return out


def _commands(block: Block) -> list[Command]:
    logical = _logical_lines(block)
    console = any(text.lstrip().startswith("$ ") for _, text in logical)
    out = []
    for number, text in logical:
        stripped = text.strip()
        if console:
            if not stripped.startswith("$ "):
                continue  # output of the command above
            stripped = stripped[2:]
        try:
            words = shlex.split(stripped, comments=True)
        except ValueError as err:
            pytest.fail(f"{block.path.relative_to(ROOT)}:{number}: cannot split `{stripped}`: {err}")
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value prefixes
        if not words:
            continue
        command = _shardwise_argv(words)
        if command is None:
            continue
        argv, module, embedded = command
        out.append(Command(block.path, number, stripped, tuple(argv), module, block.needs,
                           embedded))
    return out


def _shardwise_argv(words: list[str]) -> tuple[list[str], str, bool] | None:
    if words[0] == "shardwise":
        return words[1:], "", False
    if re.fullmatch(r"python3?", words[0]) and len(words) >= 3 and words[1] == "-m":
        if words[2] == "shardwise":
            return words[3:], "", False
        if words[2].startswith("shardwise."):
            return words[3:], words[2], False
        return None
    for i, word in enumerate(words[:-1]):  # torchrun / srun ... -m shardwise ARGS
        if word == "-m" and words[i + 1] == "shardwise":
            return words[i + 2:], "", True
    return None


BLOCKS = [b for path in DOCS for b in _blocks(path)]
COMMANDS = [c for b in BLOCKS if b.lang in SHELL for c in _commands(b)]
TOML_BLOCKS = [b for b in BLOCKS if b.lang == "toml"]


def test_the_docs_are_found():
    names = {p.name for p in DOCS}
    assert {"README.md", "layouts.md", "runspec.md", "internals.md"} <= names
    assert len(COMMANDS) > 40 and len(TOML_BLOCKS) > 5


# --- shell commands ------------------------------------------------------------------------------


def _parse(cmd: Command):
    from shardwise.cli.main import build_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(list(cmd.argv))
    except SystemExit:
        message = stderr.getvalue().strip().splitlines()
        pytest.fail(f"{cmd.where}: `{cmd.text}` is not a valid shardwise command: "
                    f"{message[-1] if message else 'argparse exited'}")


def _repo_file(text: str | None) -> Path | None:
    """The repository file a config argument names, or None for a placeholder (CONFIG,
    my_run.toml): those stand for the reader's own file."""
    if not text:
        return None
    path = ROOT / text
    return path if path.is_file() else None


def _keys(section: str, cls: type) -> set[str]:
    """The keys a section's table may hold: [model] holds family, init and the keys of the
    families (spec/model.py), each family its own."""
    if cls is ModelSection:
        return {"family", "init"} | {f.name for c in (*FAMILY_FIELDS.values(), BuilderFields)
                                     for f in dataclasses.fields(c)}
    return {f.name for f in dataclasses.fields(cls)}


def _check_overrides(cmd: Command, config: str | None, overrides: list[str]) -> None:
    for item in overrides:
        try:
            section, key, _ = parse_override(item)
        except SpecError as err:
            pytest.fail(f"{cmd.where}: --set {item}: {err}")
        sections = {f.name: f for f in dataclasses.fields(RunSpec)}
        if section not in sections:
            pytest.fail(f"{cmd.where}: --set {item}: there is no section [{section}] in the RunSpec")
        if key not in _keys(section, typing.get_type_hints(RunSpec)[section]):
            pytest.fail(f"{cmd.where}: --set {item}: [{section}] has no key {key!r}")
    try:
        load_spec(_repo_file(config), overrides)
    except SpecError as err:
        pytest.fail(f"{cmd.where}: `{cmd.text}`: the spec does not load: {err}")


def _check_semantics(cmd: Command, args) -> None:
    for word in cmd.argv:  # paths into the repository must exist
        if re.match(r"(examples|benchmarks|containers|docs|tests|src)/", word) \
                and not (ROOT / word).exists():
            pytest.fail(f"{cmd.where}: `{cmd.text}` names {word}, which does not exist")
    if hasattr(args, "overrides"):
        _check_overrides(cmd, getattr(args, "config", None), args.overrides)
    if args.command == "verify" and not args.ledger:
        from shardwise.verify.layouts import parse_layout

        for name in filter(None, (n.strip() for n in args.layouts.split(","))):
            try:
                parse_layout(name)
            except UserError as err:
                pytest.fail(f"{cmd.where}: layout {name!r}: {err}")
        if args.resume_layout:
            parse_layout(args.resume_layout)
    if args.command == "plan":
        from shardwise.planner.cluster import PRESETS as CLUSTERS
        from shardwise.planner.models import PRESETS as MODELS

        for value, presets, what in ((args.model, MODELS, "model"),
                                     (args.cluster, CLUSTERS, "cluster")):
            if value and "/" not in value and "." not in value and value not in presets:
                pytest.fail(f"{cmd.where}: --{what} {value} is not a preset "
                            f"({', '.join(presets)}) nor a file")
    if args.command == "export":
        from shardwise.cli.export import FORMATS

        assert args.format in FORMATS, f"{cmd.where}: --format {args.format} is not one of {FORMATS}"


def _needs_a_cluster(cmd: Command, args) -> bool:
    if cmd.embedded:
        nnodes = re.search(r"--nnodes[ =](\d+)", cmd.text)
        return bool(nnodes and int(nnodes[1]) > 1)
    return args.command == "launch" and (args.execute or (args.slurm and not args.dry_run))


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where for c in COMMANDS])
def test_command_is_accepted(cmd: Command):
    if cmd.module:
        assert importlib.util.find_spec(cmd.module) is not None, \
            f"{cmd.where}: `{cmd.text}`: there is no module {cmd.module}"
        if cmd.module == "shardwise.spec.reference":
            assert all(a in ("--check", "docs/runspec.md") or a.startswith(">")
                       for a in cmd.argv), f"{cmd.where}: `{cmd.text}`"
        return
    args = _parse(cmd)
    _check_semantics(cmd, args)
    if _needs_a_cluster(cmd, args):
        assert cmd.needs == "cluster", (f"{cmd.where}: `{cmd.text}` needs a cluster: put "
                                        "<!-- needs: cluster --> on the line before its block")


def test_needs_markers_are_known_and_mark_a_block():
    problems = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not _ANY_NEEDS.search(line):
                continue
            match = _NEEDS.match(line)
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            if not match or match[1] not in NEEDS:
                problems.append(f"{where}: write <!-- needs: cluster --> or <!-- needs: gpu -->")
            elif i + 1 >= len(lines) or not _FENCE.match(lines[i + 1]):
                problems.append(f"{where}: the marker must be on the line right before a code block")
    assert not problems, "\n".join(problems)


# --- TOML snippets ---------------------------------------------------------------------------------


def _spec_kind(data: dict) -> tuple[str, dict[str, type]] | None:
    run = {f.name: typing.get_type_hints(RunSpec)[f.name] for f in dataclasses.fields(RunSpec)}
    cluster = {f.name: typing.get_type_hints(ClusterSpec)[f.name]
               for f in dataclasses.fields(ClusterSpec)}
    names = set(data)
    if names & set(cluster) and not names & set(run):
        return "cluster", cluster
    if names & set(run) or any(difflib.get_close_matches(n, list(run), n=1, cutoff=0.8)
                               for n in names):
        return "run", run
    return None


def _line_of(block: Block, section: str, key: str | None = None) -> int:
    in_section = False
    for number, text in block.lines:
        stripped = text.strip()
        if re.fullmatch(r"\[\s*" + re.escape(section) + r"\s*\]\s*(#.*)?", stripped):
            in_section = True
            if key is None:
                return number
        elif stripped.startswith("["):
            in_section = False
        elif in_section and key is not None and re.match(re.escape(key) + r"\s*=", stripped):
            return number
    return block.line


@pytest.mark.parametrize("block", TOML_BLOCKS,
                         ids=[f"{b.path.relative_to(ROOT)}:{b.line}" for b in TOML_BLOCKS])
def test_toml_snippet_is_a_valid_spec(block: Block):
    where = f"{block.path.relative_to(ROOT)}"
    try:
        data = tomllib.loads("\n".join(text for _, text in block.lines))
    except tomllib.TOMLDecodeError as err:
        pytest.fail(f"{where}:{block.line}: not valid TOML: {err}")
    kind = _spec_kind(data)
    if kind is None:
        return  # not a RunSpec or a cluster file (e.g. pyproject)
    name, sections = kind
    for section, values in data.items():
        if section not in sections:
            pytest.fail(f"{where}:{_line_of(block, section)}: unknown section [{section}] in a "
                        f"{name} spec; sections: {', '.join(sections)}")
        keys = _keys(section, sections[section])
        for key in values:
            if key not in keys:
                pytest.fail(f"{where}:{_line_of(block, section, key)}: unknown key "
                            f"{section}.{key}; [{section}] has {', '.join(sorted(keys))}")
    try:
        if name == "run":
            spec_from_dict(data, origin=f"{where}:{block.line}").validate()
        else:
            from shardwise.planner.cluster import presets

            cluster_from_dict(data, origin=f"{where}:{block.line}", presets=presets())
    except SpecError as err:
        pytest.fail(f"{where}:{block.line}: {err}")


# --- links -----------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)")


def _prose(path: Path) -> list[tuple[int, str]]:
    """Lines outside fenced blocks, with inline code spans blanked out."""
    out, fence = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match[2]
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: the heading's text (code spans as text, a
    link as its text) lower-cased, punctuation dropped, spaces as hyphens; repeats get -1, -2."""
    found: set[str] = set()
    fence = None
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _FENCE.match(line)
        if fence is None and match:
            fence = match[2]
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading[1]).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        candidate, n = slug, 1
        while candidate in found:
            candidate, n = f"{slug}-{n}", n + 1
        found.add(candidate)
    return found


LINKS = [(path, number, target) for path in DOCS for number, line in _prose(path)
         for target in [*(m[1] for m in _LINK.finditer(line)),
                        *(m[1] for m in [_REF_LINK.match(line)] if m)]
         if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


@pytest.mark.parametrize("path,line,target", LINKS,
                         ids=[f"{p.relative_to(ROOT)}:{n}:{t}" for p, n, t in LINKS])
def test_relative_link_points_at_a_file(path: Path, line: int, target: str):
    where = f"{path.relative_to(ROOT)}:{line}"
    assert not target.startswith("/"), f"{where}: {target} is absolute; link relatively"
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    assert resolved.exists(), f"{where}: {target} points at {resolved}, which does not exist"
    assert ROOT in resolved.parents or resolved == ROOT, f"{where}: {target} leaves the repository"
    if anchor and resolved.suffix == ".md":
        anchors = _anchors(resolved)
        assert anchor in anchors, (f"{where}: {target}: no heading with the anchor #{anchor} in "
                                   f"{resolved.relative_to(ROOT)}; there are {sorted(anchors)}")


# --- the layers in docs/internals.md -------------------------------------------------------------


def test_internals_lists_the_layers_of_test_layers():
    from tests.unit.test_layers import LAYERS

    rows = [line for line in (ROOT / "docs" / "internals.md").read_text().splitlines()
            if re.match(r"^\| \d+ \|", line)]
    documented = [{"" if name == "shardwise/__init__.py" else name
                   for name in re.findall(r"`([^`]+)`", row.split("|")[2])} for row in rows]
    assert documented == LAYERS, ("docs/internals.md's layer table (top to bottom) must match "
                                  f"LAYERS in tests/unit/test_layers.py: {documented} != {LAYERS}")
