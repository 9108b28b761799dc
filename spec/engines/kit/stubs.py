"""Stubs for heavy modules an engine imports at module level, as verl's own CPU tests do.

:func:`import_with_stubs` reads the target module's *module-level* imports (its AST), imports each
one it names under the given packages for real where that works, and puts a stub module in
``sys.modules`` only for those that do not import here. Record types the preparation code builds
(e.g. TorchTitan's ``VarlenMetadata``) can be given as plain stand-ins in ``records``, so their
fields stay readable. Nothing of the target module is changed.

Two kinds of stub. ``strict=True`` (:class:`StrictModule`, what a new adapter should use, docs/writing-an-adapter.md):
reading any name of the stub works (an import binds it; a class may subclass it), but *using* a name nobody declared
(calling it, testing its truth, iterating it, turning it into a number) raises :class:`StubError` naming it and how
to declare it (``records={"pkg.mod": {"name": value}}``). So a stub cannot change the code under test unnoticed:
a ``MagicMock`` stub's ``is_npu_available()`` is truthy, and one library then silently turned its
``torch.compile`` off. The default (``strict=False``) keeps the ``MagicMock`` stubs the verl adapters were written
against.

**Well-known values** (:data:`WELL_KNOWN`, :func:`well_known`): the names libraries *use* at import time, given
the value they have on a machine without the stubbed package, declared once here so that no adapter writes them
by hand: an availability probe (``is_torch_npu_available``, any ``is_<x>_available`` of a stub) returns False (the
package is not installed here, so that is its true answer); a JIT or remote decorator (``numba.njit``,
``numba.jit``, ``ray.remote``, ``torch_npu``-style ``*.jit``) returns the function or class it decorates, bare or
called with options (``@njit`` and ``@njit(cache=True)``), so the code under test runs as plain Python;
``uvloop.install()`` does nothing; deepspeed's ``GatheredParameters`` is a no-op context manager (parameters are
never partitioned here). Anything else is still :class:`Undeclared`: no lenient default that makes an NPU check
truthy or turns off a ``torch.compile``.

The scanner (:func:`module_level_imports`) follows the module-level imports of every module the target imports on
the way, in any package (not only the target's own: a trainer module importing ``lib.utils``, which imports
deepspeed, or another distribution's module that does), the ``__init__`` of each package on the way (Python runs
them), and resolves a relative import in a package's ``__init__`` against that package itself.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import types
import warnings
from dataclasses import dataclass, field
from unittest import mock

from ...protocol.errors import StubError

__all__ = ["StubReport", "StubError", "StrictModule", "Undeclared", "import_with_stubs", "import_verl_module",
           "module_level_imports", "strict_module", "library_imports", "without_init", "WELL_KNOWN", "well_known",
           "passthrough_decorator", "GatheredParameters"]


def passthrough_decorator(*args, **kwargs):
    """A JIT/remote decorator of a package not installed here (``numba.njit``, ``ray.remote``): the decorated
    function or class itself, used bare (``@njit``) or with options (``@njit(cache=True)``)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda fn: fn


class GatheredParameters:
    """deepspeed's ``zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`` where no
    parameter is partitioned (one process, deepspeed not installed): a context manager that does nothing."""

    def __init__(self, params=None, modifier_rank=None, fwd_module=None, enabled=True):
        self.params = params

    def __enter__(self):
        return self.params

    def __exit__(self, *exc):
        return False


def _unavailable(*args, **kwargs) -> bool:
    """An availability probe of a package not installed here: it is not available."""
    return False


def _nothing(*args, **kwargs) -> None:
    return None


#: the value a name of a stubbed package has here, by its dotted path (see the module docstring); probes named
#: ``is_<x>_available`` return False wherever they sit (:func:`well_known`)
WELL_KNOWN: dict[str, object] = {
    "numba.njit": passthrough_decorator, "numba.jit": passthrough_decorator,
    "numba.vectorize": passthrough_decorator, "numba.guvectorize": passthrough_decorator,
    "ray.remote": passthrough_decorator, "ray.method": passthrough_decorator,
    "uvloop.install": _nothing,
    "deepspeed.zero.GatheredParameters": GatheredParameters,
    "deepspeed.comm.is_initialized": _unavailable, "deepspeed.is_initialized": _unavailable,
    "torch_npu.npu.is_available": _unavailable,
}

_MISSING = object()


def well_known(path: str) -> object:
    """The well-known value of stub name ``path`` (:data:`WELL_KNOWN`; an ``is_<x>_available`` probe: False), or
    a sentinel when there is none (the name stays :class:`Undeclared`)."""
    if path in WELL_KNOWN:
        return WELL_KNOWN[path]
    last = path.rsplit(".", 1)[-1]
    if last.startswith("is_") and last.endswith("_available"):
        return _unavailable
    return _MISSING


class Undeclared:
    """A name of a :class:`StrictModule` nobody declared. Reading it (and its attributes) is allowed; using it
    raises :class:`StubError`. It may be a base class (the subclass is a plain class of that name)."""

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> "Undeclared":
        if name.startswith("__"):
            raise AttributeError(name)
        known = well_known(f"{self._path}.{name}")
        return Undeclared(f"{self._path}.{name}") if known is _MISSING else known

    def _refuse(self, how: str):
        module, _, attr = self._path.rpartition(".")
        raise StubError(f"{self._path} is a stub nobody declared, and the code under test {how} it: declare its "
                        f"value, import_with_stubs(..., records={{{module!r}: {{{attr!r}: ...}}}}, strict=True)")

    def __call__(self, *args, **kwargs):
        self._refuse("called")

    def __bool__(self):
        self._refuse("tested the truth of")

    def __iter__(self):
        self._refuse("iterated")

    def __len__(self):
        self._refuse("took the len() of")

    def __int__(self):
        self._refuse("read as a number")

    __float__ = __index__ = __int__

    def __mro_entries__(self, bases):
        return (type(self._path.rsplit(".", 1)[-1], (), {"__module__": self._path.rsplit(".", 1)[0]}),)

    def __repr__(self) -> str:
        return f"<undeclared stub {self._path}>"


class StrictModule(types.ModuleType):
    """A stub module: declared names hold their values; any other name is :class:`Undeclared`."""

    def __init__(self, name: str, values: dict[str, object] | None = None):
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so submodules resolve
        self.__spec__ = None
        for attr, value in (values or {}).items():
            setattr(self, attr, value)

    def __getattr__(self, name: str) -> Undeclared:
        if name.startswith("__"):
            raise AttributeError(name)
        known = well_known(f"{self.__name__}.{name}")  # declared once for every adapter (WELL_KNOWN)
        return Undeclared(f"{self.__name__}.{name}") if known is _MISSING else known


def strict_module(name: str, values: dict[str, object] | None = None) -> StrictModule:
    """Put a :class:`StrictModule` (and its parent packages) in ``sys.modules`` under ``name``, unless a module
    is already there; return what is there."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), StrictModule(".".join(parts[:i])))
    module = sys.modules.setdefault(name, StrictModule(name, values))
    return module


def _is_stub(module: object) -> bool:
    return isinstance(module, (mock.MagicMock, StrictModule))


@dataclass
class StubReport:
    module: types.ModuleType
    real: list[str] = field(default_factory=list)
    stubbed: list[str] = field(default_factory=list)


def module_level_imports(module_name: str, packages: tuple[str, ...]) -> list[str]:
    """The modules under ``packages`` that importing ``module_name`` imports at module level (not in functions, not
    under ``try``/``if``): its own imports, those of every module it imports on the way (in any package whose source
    is found and that is not imported already: a module already in ``sys.modules`` imported its own), and those of
    the ``__init__`` of every package on the way (Python runs them). A relative import in a package's ``__init__``
    resolves against that package."""
    found: list[str] = []
    todo, seen = _with_parents(module_name), set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        path = _source_file(name)
        if path is None:
            continue
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        package = name if os.path.basename(path) == "__init__.py" else name.rpartition(".")[0]
        for imported in _imports(tree, package):
            if imported.split(".")[0] in packages:
                if imported not in found:
                    found.append(imported)
            elif imported not in seen and not _imported(imported):
                todo += [n for n in _with_parents(imported) if n not in seen]
    return found


def _imports(tree: ast.Module, package: str) -> list[str]:
    """The modules a module's top-level statements import (``from . import x``: the submodule ``package.x`` where
    it is one, else ``package``), relative ones resolved against ``package`` (the module's own package; for a
    package's ``__init__``, the package itself)."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            if not base:
                continue
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names
                      if alias.name != "*" and not _imported(base) and _source_file(f"{base}.{alias.name}")]
    return names


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b", "a.b.c"]``: what importing it runs, in order."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _imported(name: str) -> bool:
    """Whether ``name`` is imported already as a real module (its own imports ran; nothing to follow)."""
    module = sys.modules.get(name)
    return module is not None and not _is_stub(module)


def _source_file(module_name: str) -> str | None:
    """The ``.py`` file of ``module_name`` found without importing it (its package may import it), or None (no such
    module here, a compiled one, a namespace package)."""
    try:
        return _source_path(module_name)
    except ImportError:
        return None


def _source_path(module_name: str) -> str:
    """The file of ``module_name``, found without importing it (its package may import it)."""
    root, *rest = module_name.split(".")
    try:
        spec = importlib.util.find_spec(root)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"no package {root} (needed for {module_name}): {exc}") from exc
    if spec is None:
        raise ImportError(f"no package {root} (needed for {module_name})")
    if not spec.submodule_search_locations:  # a plain module
        if rest or not (spec.origin or "").endswith(".py"):
            raise ImportError(f"no source for {module_name}")
        return spec.origin
    path = os.path.join(list(spec.submodule_search_locations)[0], *rest)
    if os.path.isdir(path):
        path = os.path.join(path, "__init__.py")
    else:
        path += ".py"
    if not os.path.exists(path):
        raise ImportError(f"no source for {module_name} ({path})")
    return path


def _install_mock(name: str, records: dict[str, object]) -> None:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            module = mock.MagicMock(name=sub)
            module.__path__ = []  # a package, so submodules resolve
            module.__spec__ = None
            sys.modules[sub] = module
    for attr, value in records.items():
        setattr(sys.modules[name], attr, value)


def import_with_stubs(module_name: str, packages: tuple[str, ...],
                      records: dict[str, dict[str, object]] | None = None, *, strict: bool = False) -> StubReport:
    """Import ``module_name``; the modules of ``packages`` it imports at module level are real where they
    import, else stubs (``records[module] = {name: stand-in}`` fills names the code under test reads). ``strict``:
    :class:`StrictModule` stubs, whose undeclared names raise :class:`StubError` when used; else ``MagicMock``."""
    records = records or {}
    report_real, report_stub = [], []
    if module_name not in sys.modules:
        for name in module_level_imports(module_name, packages):
            if name in sys.modules and not _is_stub(sys.modules[name]):
                report_real.append(name)
                continue
            try:
                importlib.import_module(name)
                report_real.append(name)
            except Exception:  # noqa: BLE001 - anything that does not import here is stubbed
                for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                    if not _is_stub(sys.modules[key]):
                        sys.modules.pop(key)
                if strict:
                    strict_module(name, records.get(name, {}))
                else:
                    _install_mock(name, records.get(name, {}))
                report_stub.append(name)
    else:
        report_stub = [n for n in module_level_imports(module_name, packages) if _is_stub(sys.modules.get(n))]
        report_real = [n for n in module_level_imports(module_name, packages) if n not in report_stub]
    return StubReport(importlib.import_module(module_name), report_real, report_stub)


def library_imports(modules: tuple[str, ...], packages: tuple[str, ...], *, strict: bool = False,
                    values: dict[str, dict[str, object]] | None = None) -> list[object]:
    """Each of ``modules`` imported in order by :func:`import_with_stubs` (``packages`` stubbed where they do not
    import here, ``values[module][name]`` declared on the stub of ``module``): the module, or for
    ``"module:attribute"`` that attribute of it. List a library's modules that import heavy packages first, so each
    is stubbed as the module that imports it at module level finds it."""
    imported: list[object] = []
    for spec in modules:
        name, _, attribute = spec.partition(":")
        module = import_with_stubs(name, packages, values, strict=strict).module
        imported.append(getattr(module, attribute) if attribute else module)
    return imported


def without_init(package: str) -> types.ModuleType:
    """``package`` in ``sys.modules`` without running its ``__init__.py`` (unless it is imported already): its
    submodules import as usual. For a package whose ``__init__`` imports what the code under test never needs and
    cannot import here (skyrl 0.4.0's ``skyrl.backends``: the Tinker API, pydantic models needing Python 3.12)."""
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise ImportError(f"no package {package}")
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return sys.modules[package]


def import_verl_module(engine: str, module_name: str, packages: tuple[str, ...],
                       records: dict[str, dict[str, object]] | None = None) -> tuple[str, StubReport]:
    """verl's version and :func:`import_with_stubs` of one of its modules, for the adapter ``engine``: an
    ImportError that says the adapter needs verl when verl is absent; verl's import-time warnings (its engine
    registry warns about every optional backend) silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            verl = importlib.import_module("verl")
        except ImportError as exc:
            raise ImportError(f"--engine {engine} needs verl installed (pip install verl): {exc}") from exc
        report = import_with_stubs(module_name, packages, records)
    return str(getattr(verl, "__version__", "?")), report
