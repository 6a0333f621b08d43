"""Running the CLI as a user does, and what its errors must look like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def flat(text: str) -> str:
    """Collapse the CLI's line wrapping so that multi-word needles match."""
    return " ".join(text.split())


def write_toml(path: Path, data: dict) -> Path:
    """A minimal TOML writer, independent of `spec_to_toml`, for test inputs."""
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value)  # a JSON string literal is a TOML basic string
            else:
                text = repr(value)
            lines.append(f"{key} = {text}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def assert_user_error(result: tuple[int, str, str], *needles: str) -> None:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert err.startswith("error:"), err
    assert "Traceback" not in err + out
    assert out == ""
    for needle in needles:
        assert needle in flat(err), (needle, err)


def shardwise(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "shardwise", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc
