"""The guard of an engine block that imports the suite (an adapter with no standalone snippet;
:func:`spec.repro.templates.engine_block`): without the suite the file says so and exits 2, never 1 (an ImportError
is no reproduction). Vendored before such a block."""

from __future__ import annotations

import sys

#: what the file binds for this module: none
BOUND = ()

#: the suite's and impl's distribution: what to pip install for the adapter
DISTRIBUTION = "rl-ioprep"

try:  # the engine is built through its adapter, which is the suite's
    import spec  # noqa: F401
except ImportError as exc:
    print(f"NOT STANDALONE: the engine is built through its adapter in the suite ({exc}): pip install {DISTRIBUTION}")
    sys.exit(2)
