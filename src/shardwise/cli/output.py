"""How the command prints what went wrong: one wrapped paragraph on stderr, never a traceback."""

from __future__ import annotations

import sys
import textwrap


def print_error(message: str) -> None:
    text = textwrap.fill(message, width=100, subsequent_indent="  ",
                         break_long_words=False, break_on_hyphens=False)
    print(f"error: {text}", file=sys.stderr)
