"""Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE`` (default ``default``).

Without ``HYPOTHESIS_PROFILE``, ``ci`` is chosen when ``CI=true`` (as on CI), else ``default``.
``ci`` is derandomized with no deadline and enough examples that every planted bug
is caught on every run; ``thorough`` is the nightly CPU job's (ten times ``ci``'s examples, so ten
times the large cases: the strategies draw a large size tier in 1/4 of the cases, see
spec/cases/strategies.py); ``cuda`` is the nightly GPU job's; ``debug`` is verbose.

The example database is chosen by ``SPEC_EXAMPLE_DB`` (``spec/run/database.py``): derandomized
profiles (``ci``) replay it read-only before drawing their cases, the others read and write it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Verbosity, settings

from .database import example_database, replay_database

__all__ = ["PROFILES", "load_profile", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "default"
_QUIET_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large]

PROFILES = {
    "default": dict(max_examples=40, deadline=None, suppress_health_check=_QUIET_CHECKS),
    "dev": dict(max_examples=10, deadline=None, suppress_health_check=_QUIET_CHECKS),
    "ci": dict(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=_QUIET_CHECKS),
    "thorough": dict(max_examples=1000, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS),
    "cuda": dict(max_examples=200, deadline=None, print_blob=True, suppress_health_check=_QUIET_CHECKS),
    "debug": dict(max_examples=10, deadline=None, verbosity=Verbosity.verbose, print_blob=True,
                  suppress_health_check=_QUIET_CHECKS),
}

_DATABASES = {True: replay_database(), False: example_database(strict=False)}  # $SPEC_EXAMPLE_DB
for _name, _kwargs in PROFILES.items():
    settings.register_profile(_name, **_kwargs)
    # derandomize=True forces database=None within one settings(); a child profile may set it.
    _db = _DATABASES[bool(_kwargs.get("derandomize"))]
    settings.register_profile(_name, settings.get_profile(_name), database=_db)


def load_profile(name: str | None = None) -> str:
    """Load ``name`` (else ``$HYPOTHESIS_PROFILE``, else ``default``); return its name."""
    on_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if on_ci else DEFAULT_PROFILE)
    if chosen not in PROFILES:
        raise ValueError(f"unknown hypothesis profile {chosen!r}; choose from {sorted(PROFILES)}")
    settings.load_profile(chosen)
    return chosen
