"""What a reproducer's check raises when the engine is wrong: :class:`Wrong` (an AssertionError, as the suite's
checks raise), by :func:`fail`, the name the suite's own checks written out into the file call. Vendored first."""

from __future__ import annotations

#: what the file binds for this module: none
BOUND = ()


class Wrong(AssertionError):
    """What the engine got wrong on this case: got vs expected."""


def fail(message):
    raise Wrong(message)
