"""What hypothesis draws from: the strategy and the seed, nothing else.

Hypothesis 6.131 and later mine the literals of every local module loaded (``sys.modules`` outside site-packages) and
draw one of them for an integer, float or string in about one draw in twenty. So a derandomized run's cases depended
on which of the suite's modules happened to be imported when it ran (pytest-xdist's order, one engine's venv against
another's) and on every literal written anywhere in them: a change to a message's number in one module re-drew the
``ci`` cases of every invariant, and a target's known-failure hits moved between runs of nearly the same tree
(measured: verl-megatron's INV-MEG-006 hits 25, 27 and 30 in three ``ci`` runs; two such reports differed in 22
fields). :func:`pin_generation` empties that pool once, at import of the profiles: hypothesis's own constants
(its fixed list of edge values: 0, -1, 2**31, NaN, ...) are still drawn, so the edge values stay in reach.

Hypothesis before 6.131 mines nothing; there this does nothing.
"""

from __future__ import annotations

from hypothesis.internal.conjecture import providers

__all__ = ["pin_generation", "mines_local_constants"]


def mines_local_constants() -> bool:
    """Whether this hypothesis draws literals from the loaded modules' source (what :func:`pin_generation` stops)."""
    return hasattr(providers, "_get_local_constants") and providers._get_local_constants is not _no_local_constants


def _no_local_constants() -> "providers.Constants":
    return _EMPTY


_EMPTY = providers.Constants() if hasattr(providers, "Constants") else None


def pin_generation() -> None:
    """Draw no literal of the suite's own (or the caller's) modules: the cases depend on the strategy and the seed
    alone. Idempotent."""
    if hasattr(providers, "_get_local_constants"):
        providers._get_local_constants = _no_local_constants
        if hasattr(providers, "CONSTANTS_CACHE"):
            providers.CONSTANTS_CACHE.cache.clear()
