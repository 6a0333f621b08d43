"""A real S3 server for the tests: s3rver on a free loopback port (installed by .ci/run with npm
into .ci/node_modules), its credentials in the environment and nothing of the machine's AWS
setup, and an s3fs client on it. A test module imports the fixtures it uses
(`from tests.support.s3 import s3env, s3rver`); without node, s3rver or s3fs they skip, saying why.
Nothing is downloaded."""

from __future__ import annotations

import queue
import re
import shutil
import subprocess
import threading
import time

import pytest

from tests.support.specs import ROOT

BUCKET = "ckpt"
S3RVER = ROOT / ".ci" / "node_modules" / "s3rver" / "bin" / "s3rver.js"


@pytest.fixture(scope="module")
def s3rver(tmp_path_factory):
    """An s3rver on a free loopback port with bucket `ckpt`; yields its endpoint URL."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[dev]')")
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the S3 tests need node and s3rver (.ci/run installs "
                    "s3rver with npm)")
    if not S3RVER.is_file():
        pytest.skip(f"s3rver is not installed at {S3RVER}: run `npm install --prefix .ci --no-save "
                    "s3rver@3.7.1` (as .ci/run does)")
    data = tmp_path_factory.mktemp("s3rver")
    proc = subprocess.Popen([node, str(S3RVER), "-d", str(data), "-a", "127.0.0.1", "-p", "0",
                             "--silent", "--configure-bucket", BUCKET],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        port, seen, deadline = None, "", time.monotonic() + 30
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            seen += line
            found = re.search(r"listening on [\d.]+:(\d+)", line)
            port = int(found.group(1)) if found else None
        if port is None:
            pytest.fail(f"s3rver did not start within 30 s: {seen!r}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3env(s3rver, monkeypatch, tmp_path):
    """s3rver's credentials in the environment, and nothing from the machine's AWS setup (no
    credential files, no instance metadata lookups off loopback)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return s3rver


def s3_fs(endpoint):
    import s3fs

    return s3fs.S3FileSystem(key="S3RVER", secret="S3RVER", endpoint_url=endpoint,
                             use_listings_cache=False, skip_instance_cache=True)
