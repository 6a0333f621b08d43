"""Path relations that decide whether a write could damage what it reads."""

from __future__ import annotations

from pathlib import Path


def is_within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or inside it, links resolved (neither need exist): what a
    write to `path` could overwrite of `folder`."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents
