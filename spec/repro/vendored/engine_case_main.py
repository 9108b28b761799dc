"""The last lines of an engine-case reproducer (:mod:`spec.repro.writer`): run the runtime's ``main`` (bound into the
file by its ``share``) and exit with its code. A real-rank reproducer ends with :mod:`.real_ranks` instead."""

from __future__ import annotations

import sys

#: what the file binds for this module: the runtime's main
BOUND = ("main",)

if __name__ == "__main__":
    sys.exit(main())
