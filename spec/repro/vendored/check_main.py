"""The main of a reproducer that runs the invariant's own check, written out verbatim with a stand-in ``Ctx``
(:mod:`spec.repro.dense`: the padding helpers on a dense batch; :mod:`spec.repro.packing`: the Megatron packer): the
check's ``fail`` raises ``Wrong`` (:mod:`.failure`); the file exits 1 printing it, 0 when the check holds. Vendored
last, after the file's ``Ctx`` (:mod:`.dense_ctx`, :mod:`.packing_ctx`), the check and what it catches."""

from __future__ import annotations

import sys

#: what the file binds for this module: the invariant, its check, the stand-in context, what a failure is (``Wrong``,
#: or any AssertionError where the engine's own assertion counts: a packer's re-assembly) and what was checked
BOUND = ("CHECK", "Ctx", "CAUGHT", "CHECKED", "verdict")


def main():
    try:
        CHECK(Ctx())
    except CAUGHT as exc:
        return verdict(str(exc) or repr(exc), CHECKED)  # an empty assertion is a failure too
    return verdict(None, CHECKED)


if __name__ == "__main__":
    sys.exit(main())
