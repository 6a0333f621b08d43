"""#26 item 15: one file-mode policy, the umask's, for everything shardwise writes (atomic writes
were 0600 while the shards beside them followed the umask, so the other users of a shared run
directory or cache met PermissionError)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shardwise.utils.files import atomic_write, atomic_write_text


@pytest.fixture(params=[0o002, 0o022, 0o077], ids=oct)
def umask(request: pytest.FixtureRequest):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_take_the_umask(tmp_path: Path, umask: int) -> None:
    """A new file, a replaced one, and one written through a callback (token arrays): each is
    0o666 & ~umask, as a plain open() would make it; no temporary file is left behind."""
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    atomic_write_text(tmp_path / "spec.toml", "a = 1\n")
    atomic_write_text(tmp_path / "spec.toml", "a = 2\n")
    atomic_write(tmp_path / "cache" / "tokens.bin", lambda tmp: tmp.write_bytes(b"\0" * 8))
    assert _mode(plain) == 0o666 & ~umask
    assert _mode(tmp_path / "spec.toml") == 0o666 & ~umask
    assert _mode(tmp_path / "cache" / "tokens.bin") == 0o666 & ~umask
    assert _mode(tmp_path / "cache") == 0o777 & ~umask
    assert (tmp_path / "spec.toml").read_text() == "a = 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "plain.txt", "spec.toml"]


def test_a_failed_atomic_write_leaves_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "manifest.json"
    atomic_write_text(target, "old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
