"""How a reproducer serves the modules of this project it carries as source (:mod:`spec.repro.carry`: a real
engine's adapter and the modules it imports, in the file's ``_CARRIED``): an import hook placed first on
``sys.meta_path``, so that the same code the suite ran is imported, nothing of the suite installed; and, before it,
the check that every package the suite ran the adapter with is installed (without one the adapter would run its
stubs). Vendored into the engine block, which then calls :func:`_require_installed` and :func:`_serve_carried`."""

from __future__ import annotations

import importlib.abc as _abc
import importlib.util as _util
import sys as _sys

#: what the file binds for this module: the carried modules' sources, by module name: (is_package, source)
BOUND = ("_CARRIED",)


def _require_installed(installed):
    """Each ``(pin, module)`` findable, else ModuleNotFoundError naming what to install (the header's Needs)."""
    for pin, module in installed:
        try:
            found = _util.find_spec(module)
        except ModuleNotFoundError:
            found = None
        if found is None:
            raise ModuleNotFoundError(f"No module named {module!r}: this reproducer needs {pin} (its header's Needs), "
                                      "installed when the suite ran it; without it the adapter would run stubs",
                                      name=module)


class _Carried(_abc.MetaPathFinder, _abc.Loader):
    """Serves the carried modules (_CARRIED) before anything installed."""

    def find_spec(self, name, path=None, target=None):
        if name in _CARRIED:
            return _util.spec_from_loader(name, self, is_package=_CARRIED[name][0])
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        exec(compile(_CARRIED[module.__name__][1], f"<carried {module.__name__}>", "exec"), module.__dict__)


def _serve_carried():
    _sys.meta_path.insert(0, _Carried())
