"""Argument checks shared by every layer of the package: each raises ``ValueError`` naming the argument."""

from __future__ import annotations

import operator
from collections.abc import Hashable
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def check_count(name: str, value: object, *, minimum: int = 0) -> int:
    """Return ``value`` as an ``int`` when it is an integer of at least ``minimum``.

    Booleans are refused: ``True`` as a token count is always a bug.
    """
    if type(value) is int and value >= minimum:  # the common case, on every hot path: no more checks
        return value
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got the bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {number}")
    return number


def check_hashable(name: str, value: T) -> T:
    """Return ``value`` when it can be a dict key (a sequence id, say)."""
    try:
        hash(value)
    except TypeError:
        raise ValueError(f"{name} must be hashable, got {type(value).__name__}") from None
    return value
