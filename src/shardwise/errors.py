"""Errors that users can fix.

A `UserError` carries a one-paragraph message that names the field (or file) and the fix. The CLI
prints it and exits with code 2, never with a traceback; everything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """A problem in what the user asked for: config, paths, layout, data."""

    exit_code = 2


class SpecError(UserError):
    """The RunSpec is invalid: unknown key, wrong type, or values that do not fit together."""


def show(value: object, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to about `limit` characters: a message quotes what
    the user wrote so they can find it, and stays one readable paragraph when that was long."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 6]} ... {text[-2:]}"


def brief(err: BaseException, limit: int = 240) -> str:
    """"TypeName: its message" on one line, cut to about `limit` characters: what someone else's
    code (a builder, transformers, botocore) raised, short enough for one paragraph."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text if len(text) <= limit else text[:limit - 4] + ' ...'}"
