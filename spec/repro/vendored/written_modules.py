"""How a reproducer runs a module of the suite it carries as source (:mod:`spec.repro.imports`: a planted helper's or
packer's module, the statement of the Megatron packing, a planted engine's module): each a module of its own under a
private name (``_written_spec_...``), made from its source. Vendored before the modules it makes."""

from __future__ import annotations

import sys
import types

#: what the file binds for this module: none
BOUND = ()


def _module(name, source):
    """The suite's own definition, written out (it imports nothing else of the suite), as module ``name``."""
    mod = sys.modules[name] = types.ModuleType(name)
    exec(compile(source, name, "exec"), mod.__dict__)
    return mod
