"""containers/Dockerfile and containers/shardwise.def cannot be built here (no Docker, no
Apptainer): parse them and check that they pin what pyproject.toml says (Python, the torch range,
the shardwise version), copy files that exist, and name the image for the run manifest; and that
the manifest records the container it runs in."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

import shardwise
from shardwise.run.manifest import IMAGE_ENV, container

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _torch_requirement() -> str:
    (torch,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch")]
    return torch.replace(" ", "")


def _dockerfile() -> tuple[dict[str, str], list[str]]:
    """(ARG defaults, instructions with continuation lines joined)."""
    text = (ROOT / "containers" / "Dockerfile").read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    args = {}
    for line in instructions:
        if line.startswith("ARG ") and "=" in line:
            name, _, value = line[4:].partition("=")
            args[name] = value.strip('"')
    return args, instructions


def _definition() -> tuple[dict[str, str], dict[str, list[str]]]:
    """(header keys, section name -> lines) of the Apptainer definition."""
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current = None
    for raw in (ROOT / "containers" / "shardwise.def").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("%"):
            current = line[1:]
            sections[current] = []
        elif current is None:
            key, _, value = line.partition(":")
            header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    return header, sections


def _python_ok(version: str) -> bool:
    low = _pyproject()["project"]["requires-python"].removeprefix(">=")
    as_tuple = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    return as_tuple(version) >= as_tuple(low)


def test_dockerfile_pins_match_pyproject():
    args, instructions = _dockerfile()
    assert args["TORCH_SPEC"] == _torch_requirement()
    assert args["SHARDWISE_VERSION"] == _pyproject()["project"]["version"] == shardwise.__version__
    assert _python_ok(args["PYTHON_VERSION"])
    assert "FROM python:${PYTHON_VERSION}-slim" in instructions
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")  # CPU by default, CUDA by build arg
    (env,) = [i for i in instructions if i.startswith("ENV ")]
    assert f"{IMAGE_ENV}=${{{IMAGE_ENV}}}" in env
    for copy in (i for i in instructions if i.startswith("COPY ")):
        for source in copy.split()[1:-1]:
            assert (ROOT / source).exists(), source
    assert instructions[-2:] == ['ENTRYPOINT ["shardwise"]', 'CMD ["--help"]']
    kept = (ROOT / "containers" / "Dockerfile.dockerignore").read_text().split()
    assert {"!pyproject.toml", "!README.md", "!src/"} <= set(kept)


def test_apptainer_definition_matches_the_dockerfile():
    args, _ = _dockerfile()
    header, sections = _definition()
    assert header["Bootstrap"] == "docker"
    assert header["From"] == f"python:{args['PYTHON_VERSION']}-slim"
    arguments = dict(line.split("=", 1) for line in sections["arguments"])
    assert arguments == {name: args[name] for name in
                         ("TORCH_SPEC", "TORCH_INDEX_URL", "SHARDWISE_VERSION")}
    for line in sections["files"]:
        source, _ = line.split()
        assert (ROOT / source).exists(), source
    assert any(line.startswith(f"export {IMAGE_ENV}=") for line in sections["environment"])
    post = "\n".join(sections["post"])
    assert '"{{ TORCH_SPEC }}"' in post and "pip install /opt/shardwise" in post
    assert sections["runscript"] == ['exec shardwise "$@"']


@pytest.mark.parametrize(("environ", "files", "expected"), [
    ({}, [], None),
    ({}, [".dockerenv"], {"runtime": "docker", "image": None}),
    ({IMAGE_ENV: "reg/shardwise:0.1.0"}, [".dockerenv"],
     {"runtime": "docker", "image": "reg/shardwise:0.1.0"}),
    ({"APPTAINER_CONTAINER": "/scratch/shardwise_0.1.0.sif"}, [],
     {"runtime": "apptainer", "image": "/scratch/shardwise_0.1.0.sif"}),
    ({"SINGULARITY_CONTAINER": "/x.sif", IMAGE_ENV: "shardwise_0.1.0.sif"}, [],
     {"runtime": "apptainer", "image": "shardwise_0.1.0.sif"}),
    ({}, ["run/.containerenv"], {"runtime": "podman", "image": None}),
])
def test_manifest_records_the_container(environ, files, expected, tmp_path):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert container(environ, tmp_path) == expected
