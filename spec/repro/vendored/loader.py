"""How an engine-case reproducer loads the two modules written beside it (:mod:`spec.repro.templates`): afresh on
every run (several files run in one process each bind their own engine and case into their runtime). Vendored after
the preamble; the file then loads ``repro_suite`` and ``repro_runtime`` with it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

#: what the file binds for this module: none
BOUND = ()


def _beside(name):
    """A module written beside this file, loaded afresh."""
    found = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(name + ".py"))
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module
    found.loader.exec_module(module)
    return module
