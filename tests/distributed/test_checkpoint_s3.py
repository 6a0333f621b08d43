"""Checkpoints on S3-compatible storage, against a real S3 server on loopback (s3rver, installed
by .ci/run with npm into .ci/node_modules): a 2-rank run saves to s3:// and resumes at another
layout with the same losses; a corrupted object is named and the resume falls back; retention,
restart detection and every bad input (uri, endpoint, credentials, bucket, missing s3fs) behave
as on disk. Skips, saying why, where node, s3rver or s3fs is missing. Nothing is downloaded."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.checkpointer import Checkpointer
from shardwise.checkpoint.layout import OWNER
from shardwise.checkpoint.storage import LOCATION_FILE, StorageSpec, open_storage
from shardwise.errors import SpecError, UserError
from tests.support.ranks import run_ranks
from tests.support.s3 import BUCKET
from tests.support.s3 import s3_fs as _fs
from tests.support.specs import tiny_spec
from tests.support.workers import train, train_single


def events(run_dir, kind):
    return [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if e["kind"] == kind]


@pytest.mark.grid  # 12 s; the S3 refusals stay in the default run
def test_two_rank_s3_run_resumes_at_another_layout(s3env, small_corpus, tmp_path):
    """FSDP at world 2 saves step 3 to s3:// (async); a single process resumes from it and its
    steps 4-6 match the uninterrupted single-process run (layout parity, 1e-5). Nothing lands in
    the run directory but location.json, through which the run's restart detection finds the
    bucket."""
    uri = f"s3://{BUCKET}/runs/fsdp2"
    s3 = {"enabled": True, "uri": uri, "endpoint_url": s3env}
    run_dir = tmp_path / "run"
    reference = train_single(tiny_spec(small_corpus, tmp_path / "ref", run={"steps": 6}))
    part1 = run_ranks(train, 2, tiny_spec(small_corpus, run_dir, run={"steps": 6, "stop_at": 3},
                                          checkpoint=s3, parallel={"nproc": 2, "dp_shard": 2}))[0]
    fs = _fs(s3env)
    names = {k.rsplit("/", 1)[-1] for k in fs.find(f"{BUCKET}/runs/fsdp2/step-000003")}
    assert {"meta.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
            "rank-00000.pt", "rank-00001.pt"} <= names
    local = run_dir / "checkpoints"
    assert sorted(p.name for p in local.iterdir()) == [LOCATION_FILE]
    assert str(Checkpointer(local, 0, False).latest()) == f"{uri}/step-000003"
    (saved,) = events(run_dir, "checkpoint")
    assert saved["path"] == f"{uri}/step-000003" and saved["mode"] == "async"
    part2 = train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6}, checkpoint=s3),
                         resume=True)
    assert events(run_dir, "resume")[-1]["path"] == f"{uri}/step-000003"
    torch.testing.assert_close(torch.tensor(part1["losses"] + part2["losses"]),
                               torch.tensor(reference["losses"]), rtol=1e-5, atol=0)


@pytest.mark.grid  # 9 s
def test_corrupted_s3_object_is_named_and_resume_falls_back(s3env, small_corpus, tmp_path,
                                                             monkeypatch, capfd):
    """A flipped byte in an object of the newest checkpoint: rejected by name, the resume takes
    the one before and trains exactly like the uninterrupted run; retention prunes on S3 too.
    The endpoint comes from $AWS_ENDPOINT_URL here."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3env)
    prefix = f"{BUCKET}/runs/single"
    s3 = {"enabled": True, "every": 2, "uri": f"s3://{prefix}", "keep_last": 2}
    run_dir = tmp_path / "run"
    reference = train_single(tiny_spec(small_corpus, tmp_path / "ref", run={"steps": 6}))
    train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6, "stop_at": 4}, checkpoint=s3))
    fs = _fs(s3env)
    shard = f"{prefix}/step-000004/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    result = train_single(tiny_spec(small_corpus, run_dir, run={"steps": 6}, checkpoint=s3),
                          resume=True)
    (rejected,) = events(run_dir, "checkpoint_rejected")
    assert rejected["path"] == f"s3://{prefix}/step-000004"
    assert rejected["problems"] == ["__0_0.distcp has the wrong SHA-256 (its bytes changed after "
                                    "the save)"]
    assert events(run_dir, "resume")[-1]["path"] == f"s3://{prefix}/step-000002"
    assert "skipping checkpoint step-000004" in capfd.readouterr().err
    assert result["losses"] == reference["losses"][2:]
    kept = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix))
    # keep_last = 2, step 4 rewritten and valid; the run's owner record stays, its lease is gone
    assert kept == [OWNER, "step-000004", "step-000006"]


def test_interrupted_s3_save_is_never_loaded(s3env, tmp_path):
    """No rename on object storage: a prefix whose meta.json was never written is an interrupted
    save; it is rejected as such, and the next save of that step replaces it."""
    storage = open_storage(StorageSpec(f"s3://{BUCKET}/runs/partial", s3env), tmp_path)
    fs = _fs(s3env)
    fs.pipe_file(f"{BUCKET}/runs/partial/step-000008/__0_0.distcp", b"half a save")
    checkpointer = Checkpointer(tmp_path, 0, False, storage=storage)
    path, rejected = checkpointer.find_valid()
    assert path is None and [v.problems for v in rejected] == [
        ("meta.json is missing (an interrupted save)",)]
    storage.prepare(storage.staging(storage.root / "step-000008"), storage.root / "step-000008")
    assert not fs.exists(f"{BUCKET}/runs/partial/step-000008")


@pytest.mark.parametrize(("spec", "env", "needle"), [
    (lambda ep: StorageSpec("s3://nobucket/x", ep), {}, "bucket 'nobucket' does not exist"),
    (lambda ep: StorageSpec(f"s3://{BUCKET}/x", ep), {"AWS_ACCESS_KEY_ID": "WRONG"},
     "refused access to bucket 'ckpt'"),
    (lambda ep: StorageSpec(f"s3://{BUCKET}/x", ep),
     {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "no S3 credentials"),
    (lambda ep: StorageSpec(f"s3://{BUCKET}/x", "http://127.0.0.1:9"), {},
     "cannot reach the S3 endpoint http://127.0.0.1:9"),
    (lambda ep: StorageSpec(f"s3://{BUCKET}/x", ep, profile="nosuch"), {}, "checkpoint.profile"),
], ids=["missing-bucket", "unknown-key", "no-credentials", "unreachable", "unknown-profile"])
def test_bad_s3_settings_are_user_errors(spec, env, needle, s3env, monkeypatch, tmp_path):
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=re.escape(needle)):
        open_storage(spec(s3env), tmp_path)


def test_missing_s3fs_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs -> ImportError
    with pytest.raises(UserError, match=r"needs the s3fs package.*shardwise\[s3\]"):
        open_storage(StorageSpec("s3://bucket/prefix"), tmp_path)


@pytest.mark.parametrize(("checkpoint", "needle"), [
    ({"uri": "gs://bucket/x"}, "the scheme 'gs' is not supported"),
    ({"uri": "s3://"}, "names no bucket"),
    ({"uri": "s3://key:secret@bucket/x"}, "carries credentials"),
    ({"endpoint_url": "http://127.0.0.1:9000"}, "apply to s3:// URIs only"),
    ({"uri": "s3://b/x", "endpoint_url": "127.0.0.1:9000"}, "must start with http://"),
], ids=["scheme", "no-bucket", "credentials-in-uri", "endpoint-without-s3", "endpoint-scheme"])
def test_bad_checkpoint_uri_is_a_spec_error(checkpoint, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        tiny_spec(Path("."), Path("."), checkpoint=checkpoint)


def test_bad_bucket_name_is_a_user_error(tmp_path):
    pytest.importorskip("s3fs")
    with pytest.raises(UserError, match="does not name a valid bucket"):
        open_storage(StorageSpec("s3://Bad_Bucket/x"), tmp_path)
