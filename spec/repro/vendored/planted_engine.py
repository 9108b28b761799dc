"""How a reproducer builds a planted engine written out over impl (:mod:`spec.repro.engine_source`): its classes
and planted helpers from the written-out module, impl's own helpers otherwise, as :mod:`spec.engines.impl.repro_snippet`
binds impl's. Vendored after the written-out modules and the tables that name what they hold."""

from __future__ import annotations

import impl

#: what the file binds for this module: the engine classes by head, the planted helpers by name, and the switches
#: that configure the planted processor, not the engine (as PlantedEngine.make drops them)
BOUND = ("_CLASSES", "_HELPERS", "_PROCESSOR_SWITCHES")


def make_engine(head, **settings):
    return _CLASSES[head](**{k: v for k, v in settings.items() if k not in _PROCESSOR_SWITCHES})


def helper(name):
    return _HELPERS.get(name) or getattr(impl, name, None)
