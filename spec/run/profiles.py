"""Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE`` (default ``default``).

Without ``HYPOTHESIS_PROFILE``, ``ci`` is chosen when ``CI=true`` (as on CI), else ``default``.
``ci`` is derandomized with no deadline and enough examples that every planted bug
is caught on every run; ``pr`` is ``ci`` with a quarter of its examples, for a user's own pull-request job (minutes
shorter; the suite's own CI runs ``ci``); ``thorough`` is for a long run by hand (ten times ``ci``'s examples, so ten
times the large cases: the strategies draw a large size tier in 1/4 of the cases, see
spec/cases/strategies.py; no workflow runs it); ``cuda`` is the nightly GPU job's; ``debug`` is verbose.
Every profile derives from hypothesis's own defaults, not from whatever profile hypothesis loaded at import, and no
profile draws the literals of the modules loaded (:mod:`.generation`): a derandomized run is the same run wherever
it runs and whatever else is imported.

The example database is chosen by ``SPEC_EXAMPLE_DB`` (``spec/run/database.py``): derandomized
profiles (``ci``) replay it read-only before drawing their cases, the others read and write it.
:func:`use_database` swaps it for every profile (the project's tests give each test an empty one).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Verbosity, settings
from hypothesis.database import ReadOnlyDatabase

from .database import example_database, replay_database
from .generation import pin_generation

__all__ = ["PROFILES", "load_profile", "use_database", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "default"
_QUIET_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large]

PROFILES = {
    "default": dict(max_examples=40, deadline=None, suppress_health_check=_QUIET_CHECKS),
    "dev": dict(max_examples=10, deadline=None, suppress_health_check=_QUIET_CHECKS),
    "ci": dict(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=_QUIET_CHECKS),
    # a user's own pull-request job: ci's streams (derandomized), a quarter of its examples; the suite's own CI and
    # every figure the docs state run ci
    "pr": dict(max_examples=25, deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=_QUIET_CHECKS),
    "thorough": dict(max_examples=1000, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS),
    "cuda": dict(max_examples=200, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS),
    "debug": dict(max_examples=10, deadline=None, verbosity=Verbosity.verbose, print_blob=True,
                  suppress_health_check=_QUIET_CHECKS),
}



#: hypothesis's own defaults: every profile derives from these, never from the settings loaded at import (with
#: a ``CI`` variable set, hypothesis loads its own ``ci`` profile first, and a profile registered without a
#: parent would inherit its ``derandomize=True``: every ``default`` run, seeds and all, would be the same run)
_BASE = settings.get_profile("default")


def _register(writer, reader) -> None:
    for name, kwargs in PROFILES.items():
        settings.register_profile(name, _BASE, **kwargs)
        # derandomize=True forces database=None within one settings(); a child profile may set it.
        settings.register_profile(name, settings.get_profile(name),
                                  database=reader if kwargs.get("derandomize") else writer)


_register(example_database(strict=False), replay_database())  # $SPEC_EXAMPLE_DB
pin_generation()  # the cases depend on the strategy and the seed alone (spec/run/generation.py)


def use_database(db, loaded: str | None = None) -> None:
    """Every profile on ``db`` from now on (the derandomized ones through a read-only view), and ``loaded``
    reloaded so that ``settings.default`` sees it. The project's tests give each test a fresh in-memory one
    (conftest.py): a measurement never replays what another test saved."""
    _register(db, None if db is None else ReadOnlyDatabase(db))
    if loaded is not None:
        settings.load_profile(loaded)


def load_profile(name: str | None = None) -> str:
    """Load ``name`` (else ``$HYPOTHESIS_PROFILE``, else ``default``); return its name."""
    on_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if on_ci else DEFAULT_PROFILE)
    if chosen not in PROFILES:
        raise ValueError(f"unknown hypothesis profile {chosen!r}; choose from {sorted(PROFILES)}")
    settings.load_profile(chosen)
    return chosen
