"""impl built and called in a standalone reproducer (:meth:`spec.engines.impl.ImplEngine.repro_snippet`): the
engine block a file carries, vendored from this module (:func:`spec.protocol.vendor.source`)."""

from __future__ import annotations

import impl

#: what the file binds for this module: none
BOUND = ()


def make_engine(head, **settings):
    return {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}[head](**settings)


def helper(name):
    return getattr(impl, name, None)
