"""A published reference set with one edit, loaded: for the tests that every field of
benchmarks/published_*.toml is checked (`shardwise.planner.published.load`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise.errors import SpecError
from shardwise.planner import published


def refusal(reference: Path, old: str, new: str, tmp_path: Path) -> str:
    """The SpecError message (whitespace folded) of `reference` with `old` replaced by `new`;
    fails if `old` is not in the file or the edited file loads."""
    text = reference.read_text(encoding="utf-8")
    assert old in text, old
    path = tmp_path / reference.name
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(SpecError) as err:
        published.load(path)
    return " ".join(str(err.value).split())
