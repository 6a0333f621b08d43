"""The checks every section's `validate()` is made of: one value against a bound or a list of
choices, each failing with a SpecError that names the field. `shardwise.spec.reference` reads the
calls to `positive`, `at_least` and `choice` from the source to fill the reference's "values"
column, so a field checked with them is documented by the check itself."""

from __future__ import annotations

import math

from shardwise.errors import SpecError, show


def positive(name: str, value: float) -> None:
    if not value > 0:
        raise SpecError(f"{name} is {value}; it must be greater than 0.")


def at_least(name: str, value: float, low: float) -> None:
    if not value >= low:  # also rejects NaN
        raise SpecError(f"{name} is {value}; it must be at least {low}.")


def choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(f"{name} is {show(value)}; choose one of {', '.join(map(repr, choices))}.")


def divisors(n: int) -> str:
    """The divisors of `n` for a message, as "[1, 2, 4]": found up to sqrt(n) (an int64 field
    would take hours by trial of every number), abridged when there are many, and not listed at
    all for a number no sane batch or width reaches."""
    if n > 10**12:
        return f"the divisors of {n}"
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    found = low + [n // d for d in reversed(low) if d * d != n]
    if len(found) > 16:
        return "[" + ", ".join(map(str, found[:8])) + ", ..., " + ", ".join(map(str, found[-4:])) + "]"
    return str(found)
