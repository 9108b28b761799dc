"""A worker process for the example-database tests: one run_invariant, the outcome as JSON.

``python -m tests.db_worker PROFILE INVARIANT MODE ENGINE [SEED]`` under ``$SPEC_EXAMPLE_DB``;
prints the outcome (``Outcome.as_dict()``) plus the profile and the database it used.
"""

from __future__ import annotations

import json
import sys

from hypothesis import Verbosity, settings

from spec.run.database import describe
from spec.run.registry import load_engine
from spec.invariants import CATALOGUE
from spec.run.profiles import load_profile
from spec.run.runner import run_invariant


def main(argv: list[str]) -> None:
    profile, invariant, mode, engine = argv[:4]
    seed = int(argv[4]) if len(argv) > 4 else None
    load_profile(profile)
    outcome = run_invariant(CATALOGUE[invariant], load_engine(engine), mode, verbosity=Verbosity.quiet, seed=seed)
    print(json.dumps({**outcome.as_dict(), "profile": profile, "derandomize": settings.default.derandomize,
                      "database": describe(settings.default.database)}))


if __name__ == "__main__":
    main(sys.argv[1:])
