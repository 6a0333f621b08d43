"""Credentials inside URIs: found (the RunSpec refuses them, `spec.secrets`) and redacted (wherever
shardwise prints or writes a URI it did not get from the spec: an S3 endpoint from
$AWS_ENDPOINT_URL, the MLflow tracking URI, the text of an exception).

Two forms are recognised: user information before the host (`https://user:password@host`,
`https://TOKEN@host`) and a query parameter whose name says it is a secret (`?token=...`,
`X-Amz-Signature=...`). `redact` keeps the rest of the URI, so a message still says which server
it was about.
"""

from __future__ import annotations

import re

MASK = "***"

#: a URI in running text: a scheme, "://", then up to whitespace or a quote
_URI = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>`]*")
#: query parameters whose value is a secret (compared lower-case)
SECRET_PARAMETERS = frozenset({
    "token", "access_token", "accesstoken", "id_token", "refresh_token", "session_token",
    "sessiontoken", "x-amz-security-token", "api_key", "apikey", "key", "secret",
    "client_secret", "password", "passwd", "pwd", "signature", "sig", "x-amz-signature",
    "x-amz-credential", "credential", "auth", "authorization"})


def has_credentials(text: str) -> bool:
    """Whether `text` holds a URI with user information or a secret query parameter."""
    return redact(text) != text


def redact(text: str) -> str:
    """`text` with every URI's user information and secret query values replaced by ***."""
    if "://" not in text:
        return text
    return _URI.sub(lambda match: _redact_uri(match[0]), text)


def _redact_uri(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:  # the last "@": a password may hold an unescaped one
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    before, question, query = tail.partition("?")
    if question:
        query, hash_, fragment = query.partition("#")
        query = "&".join(map(_redact_parameter, query.split("&"))) + hash_ + fragment
    return f"{scheme}://{authority}{before}{question}{query}"


def _redact_parameter(parameter: str) -> str:
    name, equals, value = parameter.partition("=")
    if equals and value and name.lower() in SECRET_PARAMETERS:
        return f"{name}={MASK}"
    return parameter
