"""The run manifest: everything needed to reproduce a run, in one JSON file.

`RUN_DIR/manifest.json` is written when a launch starts and copied into every checkpoint. It names
the spec (and its hash), data and tokenizer hashes, code version, Python/torch/package versions,
seed, topology (world size, mesh, hostnames, devices), checkpoint lineage (which checkpoint each
launch resumed from and the hash of that checkpoint's manifest) and the FLOPs formula and peak
FLOP/s that define the run's MFU.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from shardwise.meta import __version__
from shardwise.spec.runspec import RunSpec

MANIFEST = "manifest.json"
FORMAT = 1


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_version() -> dict[str, Any]:
    """git commit, dirty flag and diff hash of the source tree shardwise runs from, if any."""
    root = Path(__file__).resolve().parents[3]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=10,
                                 check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.decode(errors="replace")

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"shardwise": __version__, "git_commit": None, "dirty": None, "diff_sha256": None}
    diff = git("diff", "HEAD") or ""
    status = git("status", "--porcelain", "--untracked-files=no") or ""
    return {"shardwise": __version__, "git_commit": commit.strip(), "dirty": bool(status.strip()),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None}


def environment() -> dict[str, Any]:
    packages = sorted(f"{d.metadata['Name']}=={d.version}"
                      for d in importlib.metadata.distributions() if d.metadata["Name"])
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "packages_sha256": hashlib.sha256("\n".join(packages).encode()).hexdigest(),
        "packages_count": len(packages),
        "container": container(),
    }


#: set by the images in containers/ (Dockerfile ENV, Apptainer %environment) to their name
IMAGE_ENV = "SHARDWISE_IMAGE"


def container(environ: dict[str, str] | None = None, root: Path = Path("/")) -> dict[str, Any] | None:
    """The container this process runs in, if any: the runtime (Apptainer/Singularity from their
    environment, Docker from /.dockerenv, Podman from /run/.containerenv) and the image (the
    name our images record in $SHARDWISE_IMAGE, else the Apptainer image file). None outside a
    container. A run's numbers depend on the image's torch and libraries, so it is recorded."""
    env = os.environ if environ is None else environ
    runtime = None
    if env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER"):
        runtime = "apptainer"
    elif (root / ".dockerenv").exists():
        runtime = "docker"
    elif (root / "run" / ".containerenv").exists():
        runtime = "podman"
    image = (env.get(IMAGE_ENV) or env.get("APPTAINER_CONTAINER")
             or env.get("SINGULARITY_CONTAINER"))
    if runtime is None and image is None:
        return None
    return {"runtime": runtime, "image": image}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def host_info(device: torch.device) -> dict[str, str]:
    """This rank's host and device; gathered over ranks by the caller."""
    return {"host": socket.gethostname(), "device": f"{device} ({device_name(device)})"}


def build_manifest(spec: RunSpec, *, run_id: str, topology: dict[str, Any],
                   lineage: list[dict[str, Any]], data_path: str, content_sha256: str,
                   tokenizer_sha256: str, telemetry: dict[str, Any] | None = None,
                   model: dict[str, Any] | None = None,
                   data_code: dict[str, str] | None = None,
                   hooks_code: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """`telemetry`: the FLOPs formula, FLOPs per token and the peak FLOP/s (with its source) the
    run's MFU is computed with (shardwise.telemetry.perf). `model`: where the model's code comes
    from (a user file's SHA-256, or a package version) and its plan. `data_code`: the file and
    SHA-256 of a `py:` dataset function; `hooks_code` those of the `run.hooks` files."""
    return {
        "format": FORMAT,
        "run_id": run_id,
        "spec_sha256": spec.digest(),
        "spec": spec.to_dict(),
        "seed": spec.run.seed,
        "precision": spec.run.precision,
        "data": {"source": spec.data.source, "path": data_path,
                 "content_sha256": content_sha256, "tokenizer_sha256": tokenizer_sha256 or None,
                 **({"code": data_code} if data_code else {})},
        "code": code_version(),
        "model": model,
        "environment": environment(),
        "topology": topology,
        "lineage": lineage,
        "telemetry": telemetry,
        **({"hooks": hooks_code} if hooks_code else {}),
    }


def lineage_after_resume(checkpoint: Path) -> list[dict[str, Any]]:
    """The lineage of a launch that resumes from `checkpoint`: the checkpoint's own lineage plus
    one entry naming it and the hash of its manifest."""
    manifest_path = checkpoint / MANIFEST
    earlier: list[dict[str, Any]] = []
    digest = None
    if manifest_path.is_file():
        digest = file_sha256(manifest_path)
        earlier = json.loads(manifest_path.read_text()).get("lineage", [])
    meta = json.loads((checkpoint / "meta.json").read_text())
    return [*earlier, {"resumed_from": str(checkpoint), "step": meta.get("step"),
                       "manifest_sha256": digest, "layout": meta.get("layout"),
                       "world_size": meta.get("world_size")}]
