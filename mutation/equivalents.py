"""Surviving mutants that no test can kill, each with the reason (reviewed by hand)."""

from __future__ import annotations

__all__ = ["EQUIVALENT", "classify"]

#: mutmut mutant name (or fnmatch glob) -> why it is equivalent
EQUIVALENT: dict[str, str] = {}


def classify(name: str) -> str | None:
    from fnmatch import fnmatch

    for pattern, reason in EQUIVALENT.items():
        if fnmatch(name, pattern):
            return reason
    return None
