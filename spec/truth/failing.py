"""How a check fails: an AssertionError whose ``facts`` say structurally what failed. The invariants' checks and the
check cores a standalone reproducer runs too (spec/truth/handoff_checks.py) raise it the same way."""

from __future__ import annotations

from typing import Any

__all__ = ["fail", "add_facts"]


def fail(message: str, **facts: Any) -> None:
    """Raise the check's AssertionError; ``facts`` (``exc.facts``) say structurally what failed, for known-failure
    records that match on them rather than on the message (:class:`spec.protocol.known.KnownFailure`): ``key``
    (the output or model-input key), ``sequence``, ``position`` (a token of that sequence)."""
    exc = AssertionError(message)
    exc.facts = facts
    raise exc


def add_facts(exc: BaseException, **facts: Any) -> None:
    """Add ``facts`` to a check's failure, keeping those it already carries (the innermost says most)."""
    exc.facts = {**facts, **getattr(exc, "facts", {})}
