"""`shardwise gc` on S3 (s3rver on loopback; skips without node, s3rver or s3fs): retention deletes
exactly the checkpoints `--dry-run` listed under the run's prefix — registered and newest kept,
another run's prefix and the bucket's other objects untouched — and never a prefix whose lease a
running launch holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.checkpoint import chain, ownership, registry
from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.layout import META
from shardwise.checkpoint.storage import StorageSpec, open_storage
from shardwise.cli.main import main
from tests.support.s3 import BUCKET
from tests.support.s3 import s3_fs as _fs


class Weights(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((2, 3), value))


def saved(endpoint: str, prefix: str, steps: tuple[int, ...], tmp: Path):
    storage = open_storage(StorageSpec(f"s3://{BUCKET}/{prefix}", endpoint), tmp)
    ckpt = Checkpointer(tmp, 0, False, storage=storage)
    for step in steps:
        ckpt.save(step, {"model": Weights(float(step))}, {})
    return storage


def keys(endpoint: str) -> set[str]:
    return set(_fs(endpoint).find(BUCKET))


@pytest.mark.grid  # 10 s; gc's rules are unit-tested on disk
def test_gc_on_s3_deletes_what_it_listed(request, tmp_path, capsys) -> None:
    s3 = request.getfixturevalue("s3env")  # (tests/support/s3.py, through conftest)
    storage = saved(s3, "runs/a", (1, 2, 3), tmp_path / "a")
    saved(s3, "runs/b", (1,), tmp_path / "b")
    _fs(s3).pipe_file(f"{BUCKET}/notes.txt", b"not a checkpoint")
    root = storage.root
    registry.add(root, registry.Entry("first", "step-000001", 1,
                                      chain.digest((root / "step-000001" / META).read_text()), {}))
    lease = ownership.LeaseLock(open_storage(StorageSpec(f"s3://{BUCKET}/runs/b", s3),
                                             tmp_path).root)
    assert lease.try_acquire("running-launch", "b") is None
    try:
        before = keys(s3)
        args = ["gc", f"s3://{BUCKET}/runs", "--keep-last", "1", "--endpoint-url", s3]
        assert main([*args, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert keys(s3) == before
        assert "would delete  step-000002" in out and "registered as 'first'" in out
        assert "skipped: in use by launch running-launch" in out
        assert main(args) == 0
        gone = before - keys(s3)
        assert {k.split("/")[3] for k in gone} == {"step-000002"}
        assert all(k.startswith(f"{BUCKET}/runs/a/step-000002/") for k in gone)
    finally:
        lease.release()
