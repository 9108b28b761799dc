"""What a reproducer's check raises when the engine is wrong: :class:`Wrong` (an AssertionError, as the suite's
checks raise), by :func:`fail`, the name the suite's own checks written out into the file call; and the file's
verdict (:func:`verdict`). Vendored first."""

from __future__ import annotations

#: what the file binds for this module: the invariant it reproduces
BOUND = ("INVARIANT",)


class Wrong(AssertionError):
    """What the engine got wrong on this case: got vs expected."""


def fail(message, **facts):
    """The suite's ``fail`` (spec/truth/failing.py), for its checks written out into the file: ``facts`` (what a
    known-failure record matches on) are the suite's, not the file's."""
    raise Wrong(message)


def verdict(problem, checked):
    """The file's exit code: 1 printing what is wrong (``problem``), else 0 saying the invariant holds on ``checked``."""
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    print(f"PASS: {INVARIANT} holds on {checked}")
    return 0
