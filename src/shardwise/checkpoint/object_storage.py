"""Checkpoints in an S3-compatible bucket, through fsspec/s3fs.

Object storage has no rename: a "rename" is a copy of every byte followed by deletes, and is not
atomic either. What it does have is an atomic PUT per object and read-after-write consistency (AWS
S3 since 2020, MinIO, Ceph, s3rver). So the shards go straight to `step-N/` and `meta.json`, which
lists every file with its size and SHA-256, is PUT last: a prefix without it, or whose objects do
not match it, is never loaded. Re-saving a step deletes its `meta.json` first, so the old
checkpoint stops counting before any of its objects change; retention deletes `meta.json` first
for the same reason. So, unlike on disk, re-saving a step that exists is not atomic: from the
start of the new save until its commit, that step has no valid checkpoint (a crash in between
leaves the next older one as the newest valid checkpoint). Staging on local disk and uploading
afterwards was rejected: it doubles the I/O and needs local room for a whole shard, and the upload
would still depend on the same meta-last rule for its atomicity.

Credentials never go in the spec (it is copied into every checkpoint): they come from the
environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN), a named profile of
~/.aws/credentials (`checkpoint.profile`), or the rest of botocore's default chain.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from shardwise.checkpoint.layout import META, STEP_DIR
from shardwise.checkpoint.location import RemotePath, StorageSpec
from shardwise.checkpoint.staging import HostCopyStage, HostStager
from shardwise.compat import fsspec_reader, fsspec_writer
from shardwise.errors import UserError
from shardwise.utils.redact import redact

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class ObjectStorage:
    """Checkpoints under an S3-compatible prefix, through fsspec/s3fs (see the module docstring
    for why meta.json written last, and not a rename, is the commit).

    Re-saving a step that already exists is not atomic: the new save deletes the old save of that
    step when it starts (`prepare`), so until its own meta.json is PUT that step has no valid
    checkpoint, and if the new save fails or the job dies in between, the old one is gone — the
    loader then falls back to the next older valid checkpoint."""

    def __init__(self, uri: str, fs: Any, storage_options: dict[str, Any]) -> None:
        scheme, _, key = uri.partition("://")
        self.uri, self.fs, self.storage_options = uri, fs, storage_options
        self.root = RemotePath(fs, key, scheme)

    def staging(self, final: RemotePath) -> RemotePath:
        return final  # no rename: meta.json written last is the commit

    def prepare(self, staging: RemotePath, final: RemotePath) -> None:
        self.remove(final)  # a stale partial save, or an earlier save of the same step

    def writer(self, location: RemotePath, stager: HostStager | None = None) -> Any:
        writer = _fsspec_writer_class()(str(location), **self.storage_options)
        writer.stager = stager
        return writer

    def reader(self, location: RemotePath) -> Any:
        return fsspec_reader()(str(location), **self.storage_options)

    def write_file(self, location: RemotePath, data: bytes) -> None:
        location.write_bytes(data)  # one PUT: atomic and durable once it returns

    def commit(self, staging: RemotePath, final: RemotePath, meta_text: str) -> None:
        """meta.json, PUT last, is the commit. A re-save of an existing step is not atomic here
        (see the module docstring): `prepare` already deleted the old save of this step."""
        (final / META).write_text(meta_text)

    def recover(self) -> None:
        """Nothing to put back: object storage never renames."""

    def remove(self, location: RemotePath) -> None:
        (location / META).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(location.key, recursive=True)

    def step_dirs(self) -> list[RemotePath]:
        root = self.root
        try:
            entries = self.fs.ls(root.key, detail=True)
        except FileNotFoundError:
            return []
        return [RemotePath(self.fs, e["name"], root.scheme) for e in entries
                if e.get("type") == "directory" and STEP_DIR.match(e["name"].rsplit("/", 1)[-1])]


_WRITER: type | None = None


def _fsspec_writer_class() -> type:
    global _WRITER
    if _WRITER is None:
        _WRITER = type("_RemoteWriter", (HostCopyStage, fsspec_writer()), {})
    return _WRITER



def s3_options(spec: StorageSpec) -> dict[str, Any]:
    """fsspec storage options for s3fs. The endpoint falls back to $AWS_ENDPOINT_URL_S3 and
    $AWS_ENDPOINT_URL (botocore reads them too; naming it here lets errors say which one)."""
    options: dict[str, Any] = {
        "use_listings_cache": False,  # other ranks and processes write the same prefixes
        "skip_instance_cache": True,  # credentials are read when a client is made, not cached
        "config_kwargs": {"connect_timeout": 10, "read_timeout": 120,
                          "retries": {"max_attempts": 3, "mode": "standard"}},
    }
    endpoint = (spec.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                or os.environ.get("AWS_ENDPOINT_URL") or "")
    if endpoint:
        options["endpoint_url"] = endpoint
    if spec.region:
        options["client_kwargs"] = {"region_name": spec.region}
    if spec.profile:
        options["profile"] = spec.profile
    return options


def open_s3(uri: str, spec: StorageSpec) -> ObjectStorage:
    bucket = uri[len("s3://"):].split("/", 1)[0]
    if not _BUCKET.match(bucket):
        raise UserError(f"checkpoint.uri = {uri!r} does not name a valid bucket ({bucket!r}); "
                        "write s3://BUCKET/PREFIX with a bucket name of 3-63 lowercase letters, "
                        "digits, dots or hyphens.")
    try:
        import s3fs
    except ImportError:
        raise UserError(f"checkpoint.uri = {uri!r} needs the s3fs package, which is not "
                        "installed. Install it with `pip install 'shardwise[s3]'` (or "
                        "`pip install s3fs`), or leave checkpoint.uri empty to keep checkpoints "
                        "in the run directory.") from None
    options = s3_options(spec)
    endpoint = options.get("endpoint_url", "the default AWS endpoint")
    try:
        fs = s3fs.S3FileSystem(**options)
        fs.call_s3("head_bucket", Bucket=bucket)
    except Exception as err:  # classified below; anything else is reported with its own text
        # the endpoint may come from $AWS_ENDPOINT_URL, and botocore's text may quote it
        raise UserError(redact(_s3_problem(err, uri, bucket, endpoint))) from None
    return ObjectStorage(uri, fs, options)


def _s3_problem(err: Exception, uri: str, bucket: str, endpoint: str) -> str:
    name = type(err).__name__
    if name == "NoCredentialsError":
        return (f"no S3 credentials for checkpoint.uri = {uri!r}. Set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY in the environment of every rank, or name a profile of "
                "~/.aws/credentials with checkpoint.profile (credentials never go in the spec: it "
                "is copied into every checkpoint).")
    if name == "ProfileNotFound":
        return (f"checkpoint.profile: {err}. Name a profile that exists in ~/.aws/credentials or "
                "~/.aws/config, or leave checkpoint.profile empty to use AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY.")
    if isinstance(err, PermissionError):
        return (f"the S3 server at {endpoint} refused access to bucket {bucket!r} ({err}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or checkpoint.profile) and that they "
                f"may list, read, write and delete under {uri}.")
    if isinstance(err, FileNotFoundError):
        return (f"bucket {bucket!r} does not exist at {endpoint}. Create it first (e.g. `aws s3 mb "
                f"s3://{bucket}`), or correct checkpoint.uri.")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ClientConnectorError", "ConnectionError") or isinstance(err, OSError):
        return (f"cannot reach the S3 endpoint {endpoint} for checkpoint.uri = {uri!r} ({err}). "
                "Check checkpoint.endpoint_url (or $AWS_ENDPOINT_URL): scheme, host and port, and "
                "that the server is running and reachable from every rank.")
    if name == "ValueError" or "endpoint" in str(err).lower():
        return (f"checkpoint.endpoint_url / $AWS_ENDPOINT_URL ({endpoint}) is not usable: {err}. "
                "Write it as http://HOST:PORT or https://HOST.")
    return (f"S3 check of checkpoint.uri = {uri!r} at {endpoint} failed: {name}: {err}. Check the "
            "endpoint, the credentials and the bucket.")


