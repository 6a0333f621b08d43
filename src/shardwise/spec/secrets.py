"""No secret in a RunSpec: the spec is copied into RUN_DIR/spec.toml, the manifest of the run and of
every checkpoint, the MLflow parameters and error messages, so a URI with credentials in any
field (`checkpoint.endpoint_url = "http://KEY:SECRET@host"`, a token in a query, a builder's
argument) is refused, with where the credentials go instead. Checked before anything else in
the spec, so that no other message quotes the secret."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from shardwise.errors import SpecError, show
from shardwise.utils.redact import has_credentials, redact

S3_FIELDS = ("checkpoint.uri", "checkpoint.endpoint_url")
S3_CREDENTIALS = ("S3 credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                  "AWS_SESSION_TOKEN) in the environment of every rank, or from a profile of "
                  "~/.aws/credentials named by checkpoint.profile")
OTHER_CREDENTIALS = ("credentials come from the environment of the process that uses them: "
                     "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or checkpoint.profile for S3, "
                     "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                     "for MLflow, HF_TOKEN for the Hugging Face hub, or your own variable read by "
                     "your code")


def check_no_credentials(table: dict[str, Any]) -> None:
    """Refuse the first string anywhere in `table` (the spec as nested tables) that holds a URI
    with user information (`user:password@`) or a secret query parameter."""
    for key, value in _strings(table, ""):
        if has_credentials(value):
            where = S3_CREDENTIALS if key in S3_FIELDS else OTHER_CREDENTIALS
            raise SpecError(
                f"{key} = {show(redact(value))} carries credentials (shown here as ***). A spec "
                "is copied into spec.toml, the manifest of the run and of every checkpoint, and "
                "the MLflow parameters, so secrets never go in it: write the URI without them, "
                f"and know that {where}.")


def _strings(value: Any, key: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _strings(item, f"{key}[{index}]")
