"""A pytest plugin for mutation runs: the ``mutation`` hypothesis profile, loaded after conftest's.

``python -m mutation`` passes ``-p mutation.pytest_profile``; the repository's conftest
loads its own profile when it is imported, and this plugin's ``pytest_configure`` (which
runs after that) replaces it. The profile is derandomized (a mutant's verdict is a pure
function of the code, so mutmut's cache stays valid), has no shrinking (a kill needs one
failing example, not a minimal one) and few examples per invariant x mode.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILE", "EXAMPLES"]

PROFILE = "mutation"
#: examples per invariant x mode (each also runs the pinned seed examples); MUTATION_EXAMPLES overrides
EXAMPLES = int(os.environ.get("MUTATION_EXAMPLES", "5"))

settings.register_profile(
    PROFILE, max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    phases=(Phase.explicit, Phase.generate), print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile(PROFILE)
