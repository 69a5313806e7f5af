"""What every config's validation shares."""

from __future__ import annotations


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)
