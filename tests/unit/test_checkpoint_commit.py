"""Re-saving a checkpoint step replaces it atomically on disk: with renameat2(RENAME_EXCHANGE)
where the OS has it, else with two renames and a recovery that puts the old checkpoint back when a
crash comes between them. At no moment is the step without a complete checkpoint."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys

import pytest
import torch
from torch import nn

from shardwise.checkpoint import storage
from shardwise.checkpoint.checkpointer import Checkpointer

STEP = "step-000004"


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((3, 5), value))


def save(root, value: float, step: int = 4) -> None:
    Checkpointer(root, 0, False).save(step, {"model": Weights(value)}, {"value": value})


def loaded_value(root, path) -> float:
    module = Weights(0.0)
    meta = Checkpointer(root, 0, False).load(path, {"model": module})
    assert torch.equal(module.w, torch.full((3, 5), meta["value"]))
    return meta["value"]


def names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def renames(monkeypatch):
    """Every os.replace call as (source name, destination name)."""
    calls: list[tuple[str, str]] = []
    real = os.replace

    def spy(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    return calls


def no_renameat2(monkeypatch) -> None:
    monkeypatch.setattr(storage, "_renameat2", lambda: None)


def test_first_save_is_a_plain_rename(tmp_path, renames):
    save(tmp_path, 1.0)
    assert (STEP + ".staging", STEP) in renames
    assert names(tmp_path) == [STEP]


@pytest.mark.skipif(storage._renameat2() is None, reason="no renameat2 in this libc/OS")
def test_exchange_dirs_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "from-a").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "from-b").write_text("b")
    assert storage.exchange_dirs(tmp_path / "a", tmp_path / "b")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["from-b"]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["from-a"]
    with pytest.raises(FileNotFoundError):
        storage.exchange_dirs(tmp_path / "a", tmp_path / "missing")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux only")
def test_resave_swaps_with_renameat2_and_verifies(tmp_path, renames, monkeypatch):
    save(tmp_path, 1.0)
    swaps = []
    real = storage.exchange_dirs
    monkeypatch.setattr(storage, "exchange_dirs", lambda a, b: swaps.append(real(a, b)) or swaps[-1])
    renames.clear()
    save(tmp_path, 2.0)
    assert swaps == [True]  # this kernel and filesystem (ext4, tmpfs) support the exchange
    assert not [r for r in renames if r[0] == STEP or r[1] == STEP]  # no rename of the old step-N
    assert names(tmp_path) == [STEP]  # the old one (under the staging name) is deleted
    path, rejected = Checkpointer(tmp_path, 0, False).find_valid()
    assert path == tmp_path / STEP and rejected == []
    assert loaded_value(tmp_path, path) == 2.0


@pytest.mark.parametrize("why", ["no-renameat2", "einval"])
def test_resave_falls_back_to_two_renames(tmp_path, renames, monkeypatch, why):
    if why == "no-renameat2":
        no_renameat2(monkeypatch)
    else:  # a filesystem that refuses RENAME_EXCHANGE (some network and FUSE filesystems)
        def refuse(*args):
            ctypes.set_errno(errno.EINVAL)
            return -1

        monkeypatch.setattr(storage, "_renameat2", lambda: refuse)
    save(tmp_path, 1.0)
    renames.clear()
    save(tmp_path, 2.0)
    assert [r for r in renames if not r[0].startswith(".")] == [  # (.meta.json.* temp files)
        (STEP, STEP + ".replaced"), (STEP + ".staging", STEP)]
    assert names(tmp_path) == [STEP]
    path, rejected = Checkpointer(tmp_path, 0, False).find_valid()
    assert path == tmp_path / STEP and rejected == []
    assert loaded_value(tmp_path, path) == 2.0


def test_other_renameat2_errors_are_raised(tmp_path, monkeypatch):
    def fail(*args):
        ctypes.set_errno(errno.EACCES)
        return -1

    monkeypatch.setattr(storage, "_renameat2", lambda: fail)
    with pytest.raises(PermissionError):
        storage.exchange_dirs(tmp_path / "a", tmp_path / "b")


@pytest.fixture
def crashed(tmp_path, monkeypatch):
    """A re-save of step 4 (value 2) that died between the fallback's two renames: the old step-4
    (value 1) is under step-000004.replaced and no step-000004 exists; step 2 is older."""
    save(tmp_path, 0.5, step=2)
    save(tmp_path, 1.0)
    no_renameat2(monkeypatch)
    real = os.replace
    calls = []

    def crash_on_second(src, dst):
        calls.append(src)
        if os.path.basename(src) == STEP + ".staging":  # the second of the two renames
            raise OSError(errno.EIO, "simulated crash")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(OSError, match="simulated crash"):
        save(tmp_path, 2.0)
    monkeypatch.setattr(os, "replace", real)
    assert [os.path.basename(c) for c in calls if "step" in os.path.basename(c)][-2:] == [
        STEP, STEP + ".staging"]
    assert names(tmp_path) == ["step-000002", STEP + ".replaced", STEP + ".staging"]
    return tmp_path


def test_crash_between_fallback_renames_keeps_the_old_checkpoint_for_find_valid(crashed):
    path, rejected = Checkpointer(crashed, 0, False).find_valid()
    assert path == crashed / STEP and rejected == []
    assert loaded_value(crashed, path) == 1.0  # the old checkpoint, intact
    assert names(crashed) == ["step-000002", STEP, STEP + ".staging"]


def test_crash_between_fallback_renames_keeps_the_old_checkpoint_for_latest(crashed):
    assert Checkpointer(crashed, 0, False).latest() == crashed / STEP
    assert loaded_value(crashed, crashed / STEP) == 1.0


def test_recover_leaves_other_ranks_listing_alone(crashed):
    """Only rank 0 renames (the others list after a barrier); latest() on rank 1 does not."""
    assert Checkpointer(crashed, 1, False).latest() == crashed / "step-000002"
    assert (crashed / (STEP + ".replaced")).is_dir()


def test_leftover_replaced_after_the_second_rename_is_deleted(tmp_path):
    """A crash after step-N was in place but before .replaced was deleted: step-N is the new one."""
    save(tmp_path, 1.0)
    shutil.copytree(tmp_path / STEP, tmp_path / (STEP + ".replaced"))
    save(tmp_path, 2.0, step=6)
    assert Checkpointer(tmp_path, 0, False).find_valid()[0] == tmp_path / "step-000006"
    assert names(tmp_path) == [STEP, "step-000006"]
