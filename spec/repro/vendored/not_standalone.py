"""The whole of a reproducer that cannot check its invariant standalone (:mod:`spec.repro.writer`): it says why and
exits 2, never 1. Vendored after the file's header and ``WHY``."""

from __future__ import annotations

import sys

#: what the file binds for this module: why the failure is not reproduced standalone
BOUND = ("WHY",)


def main():
    print(f"NOT STANDALONE: {WHY}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
