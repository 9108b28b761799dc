"""A planted engine's own companion (a planted processor class's classmethod; :mod:`spec.repro.engine_source`): the
file's ``logits_processor``, which the runtime hands the engine instead of the suite's stand-in. Vendored after the
written-out module that defines it."""

from __future__ import annotations

#: what the file binds for this module: the companion, written out
BOUND = ("_OWN_PROCESSOR",)


def logits_processor(case, sp_size, sp_rank):  # the engine's own companion
    return _OWN_PROCESSOR(case, sp_size, sp_rank)
