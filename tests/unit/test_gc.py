"""`shardwise gc` on synthetic run directories: retention across runs deletes exactly what
`--dry-run` listed and nothing else (registered, newest-N and every-K checkpoints kept, an
interrupted save removed), a running (locked) run is never touched, abandoned branch lines go
only when asked; a data-removal request deletes one dataset's derived caches, records it, and a
run needing them is refused until `--allow-rebuild`, after which they rebuild identically."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shardwise.checkpoint import ownership
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.cli.main import main
from shardwise.data.prepare import prepare_data
from shardwise.data.removal import LOG
from shardwise.errors import UserError
from shardwise.run.branch import make_branch
from shardwise.run.register import register
from shardwise.spec import RunSpec
from shardwise.spec.runspec import DataSection


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), value))


def make_run(root: Path, name: str, steps: tuple[int, ...]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "spec.toml").write_text("")
    ckpt = Checkpointer(run / "checkpoints", 0, False)
    for step in steps:
        ckpt.save(step, {"model": Weights(float(step))}, {})
    return run


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def gc(capsys, *args: str) -> tuple[int, str]:
    code = main(["gc", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out


def test_gc_deletes_what_dry_run_listed_and_nothing_else(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    a = make_run(runs, "a", (1, 2, 3, 4, 5))
    b = make_run(runs, "b", (2, 4, 6, 8))
    register(a, "first", step=1)
    (b / "checkpoints" / "step-000010.staging").mkdir()  # a save a crash interrupted
    (b / "checkpoints" / "step-000010.staging" / "__0_0.distcp").write_bytes(b"x" * 10)
    before = files(tmp_path)
    code, out = gc(capsys, str(runs), "--keep-last", "2", "--keep-every", "4", "--dry-run")
    assert code == 0 and files(tmp_path) == before
    listed, location = set(), ""
    for line in out.splitlines():
        location = line.split()[0] if not line.startswith(" ") else location
        if line.startswith("  would delete"):
            listed.add((Path(location).parent.name, line.split()[2]))
    assert listed == {("a", "step-000002"), ("a", "step-000003"), ("b", "step-000002"),
                      ("b", "step-000010.staging")}
    assert "registered as 'first'" in out and "would delete 4 checkpoints" in out
    code, out = gc(capsys, str(runs), "--keep-last", "2", "--keep-every", "4")
    assert code == 0 and "deleted 4 checkpoints" in out
    gone = before - files(tmp_path)
    assert {(p.split("/")[1], p.split("/")[3]) for p in gone} == listed
    assert sorted(p.name for p in (a / "checkpoints").glob("step-*")) == [
        "step-000001", "step-000004", "step-000005"]
    assert sorted(p.name for p in (b / "checkpoints").iterdir() if p.name.startswith("step")) == [
        "step-000004", "step-000006", "step-000008"]


def test_gc_never_touches_a_running_run(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    a = make_run(runs, "a", (1, 2, 3))
    b = make_run(runs, "b", (1, 2, 3))
    lock = ownership.FileLock(b / "checkpoints")
    assert lock.try_acquire("running-launch", "b-id") is None
    try:
        before_b = files(b)
        code, out = gc(capsys, str(a), str(b), "--keep-last", "1")
        assert code == 0 and "skipped: in use by launch running-launch" in out
        assert files(b) == before_b
        assert sorted(p.name for p in (a / "checkpoints").glob("step-*")) == ["step-000003"]
    finally:
        lock.release()


def test_gc_drops_abandoned_lines_only_when_asked(tmp_path: Path, capsys) -> None:
    run = make_run(tmp_path, "run", (2, 4, 6))
    register(run, "keep-me", step=6)
    make_branch(run, RunSpec(), "2", "id")
    code, out = gc(capsys, str(run), "--keep-last", "1")
    assert code == 0 and "deleted 0 checkpoints" in out and "--drop-abandoned deletes it" in out
    code, out = gc(capsys, str(run), "--keep-last", "1", "--drop-abandoned")
    assert "deleted 1 checkpoint " in out
    (line,) = (run / "checkpoints" / "abandoned").iterdir()
    assert [p.name for p in line.iterdir()] == ["step-000006"]  # registered: kept


def test_gc_refuses_bad_input(tmp_path: Path, capsys) -> None:
    for args, needle in ((["gc"], "one thing at a time"),
                         (["gc", str(tmp_path), "--keep-last", "0"], "at least the newest"),
                         (["gc", str(tmp_path / "nothing")], "neither a run directory"),
                         (["gc", "--data", "0123456789abcdef"], "--reason is required"),
                         (["gc", "--allow-rebuild", "0123456789abcdef", "--reason", "x",
                           "--cache-dir", str(tmp_path)], "nothing to allow")):
        assert main(args) == 2, args
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith("error:") and needle in err, (needle, err)


def test_data_removal_deletes_records_and_refuses_until_allowed(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"line {i} of a small corpus, to be forgotten." * 20
                                  for i in range(40)))
    cache = tmp_path / "cache"
    section = DataSection(source=str(corpus), seq_len=16, vocab_size=300, cache_dir=str(cache))
    first = prepare_data(section)
    other = cache / "corpus-ffffffffffffffff"  # another dataset's caches
    other.mkdir()
    (other / "tokens.npy").write_bytes(b"other")
    mine = cache / f"corpus-{first.content_hash[:16]}"
    assert mine.is_dir()
    before = files(cache)
    code, out = gc(capsys, "--data", str(corpus), "--reason", "request 42", "--cache-dir",
                   str(cache), "--dry-run")
    assert code == 0 and f"would delete  {mine}" in out and files(cache) == before
    code, out = gc(capsys, "--data", first.content_hash, "--reason", "request 42", "--by",
                   "dpo@example", "--cache-dir", str(cache))
    assert code == 0 and not mine.exists()
    assert files(cache) == {p for p in before if not p.startswith(mine.name + "/")} | {LOG}
    (record,) = [json.loads(x) for x in (cache / LOG).read_text().splitlines()]
    assert (record["kind"], record["why"], record["by"]) == ("delete", "request 42", "dpo@example")
    assert record["deleted"][0]["path"] == str(mine) and record["deleted"][0]["bytes"] > 0
    with pytest.raises(UserError, match=r"were deleted on .* by dpo@example for a data-removal"):
        prepare_data(section)
    assert main(["gc", "--allow-rebuild", str(corpus), "--reason", "consent given",
                 "--cache-dir", str(cache)]) == 0
    again = prepare_data(section)
    assert np.array_equal(np.asarray(again.train), np.asarray(first.train))
    shutil.rmtree(cache)
