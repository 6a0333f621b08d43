"""#26 item 9: a checkpoint volume that fills up. On a small tmpfs (root mounts one, as the drill
in docs/checkpoints.md does) a save that cannot fit ends the run with one paragraph — how much
is free, how much a checkpoint needs, the newest valid checkpoint — and exit 2; nothing is lost:
once there is room, `--resume` finishes the run with an exact ledger. Before: a Python traceback
per rank and torch's "enforce fail at inline_container.cc ... unexpected pos"."""

from __future__ import annotations

import os
import subprocess

import pytest

from shardwise.cli.main import main
from shardwise.data.ledger import audit
from shardwise.spec import spec_from_dict, spec_to_toml
from tests.support.cli import flat
from tests.support.specs import tiny_spec_dict


@pytest.fixture
def small_volume(tmp_path):
    """A 1 MB tmpfs (a tiny run's checkpoint is about 1.4 MB); `resize(mb)` grows it in place."""
    path = tmp_path / "volume"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")

    def resize(mb: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mb}m", str(path)], check=True)

    try:
        yield path, resize
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_full_checkpoint_volume_is_named_and_loses_nothing(small_volume, small_corpus,
                                                             tmp_path, capsys):
    volume, resize = small_volume
    run_dir = tmp_path / "run"
    data = tiny_spec_dict(small_corpus, run_dir, run={"dir": str(run_dir), "steps": 4},
                          checkpoint={"enabled": True, "every": 2, "uri": str(volume / "ckpt"),
                                      "async_save": False})
    config = tmp_path / "job.toml"
    config.write_text(spec_to_toml(spec_from_dict(data).validate()))

    # not even one checkpoint fits: the write fails, and is said in words
    assert main(["train", str(config)]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "inline_container" not in err
    assert "the checkpoint volume is full" in flat(err)
    assert "step 2 was not saved" in flat(err) and "none yet" in flat(err)

    # one fits, two do not: refused before the second is written
    resize(2)
    assert main(["train", "--resume", str(run_dir)]) == 2
    err = flat(capsys.readouterr().err)
    assert "the checkpoint volume is full" in err and "a checkpoint needs" in err
    assert "step 4 was not saved" in err and "The newest valid checkpoint is step-000002" in err
    assert (volume / "ckpt" / "step-000002" / "meta.json").is_file()

    resize(20)
    assert main(["train", "--resume", str(run_dir)]) == 0
    report = audit(run_dir)
    assert report.exact and report.steps == 4, report.problems
