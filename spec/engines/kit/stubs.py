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
           "module_level_imports", "strict_module", "library_imports", "without_init"]


class Undeclared:
    """A name of a :class:`StrictModule` nobody declared. Reading it (and its attributes) is allowed; using it
    raises :class:`StubError`. It may be a base class (the subclass is a plain class of that name)."""

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> "Undeclared":
        if name.startswith("__"):
            raise AttributeError(name)
        return Undeclared(f"{self._path}.{name}")

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
        return Undeclared(f"{self.__name__}.{name}")


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
    """The modules under ``packages`` that ``module_name`` imports at module level (not in functions),
    directly or through the modules of its own package it imports at module level."""
    package = module_name.rsplit(".", 1)[0]
    found: list[str] = []
    todo, seen = [module_name], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        with open(_source_path(name), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in tree.body:
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                base = name.rsplit(".", node.level)[0] + "." if node.level else ""
                names.append(base + node.module)
            elif isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            for imported in names:
                if imported.split(".")[0] in packages and imported not in found:
                    found.append(imported)
                elif imported.startswith(package + ".") and os.path.exists(_source_path(imported)):
                    todo.append(imported)
    return found


def _source_path(module_name: str) -> str:
    """The file of ``module_name``, found without importing it (its package may import it)."""
    root, *rest = module_name.split(".")
    spec = importlib.util.find_spec(root)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"no package {root} (needed for {module_name})")
    path = os.path.join(list(spec.submodule_search_locations)[0], *rest)
    return os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"


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


def library_imports(modules: tuple[str, ...], packages: tuple[str, ...], *, strict: bool = False) -> list[object]:
    """Each of ``modules`` imported in order by :func:`import_with_stubs` (``packages`` stubbed where they do not
    import here): the module, or for ``"module:attribute"`` that attribute of it. List a library's modules that
    import heavy packages first, so each is stubbed as the module that imports it at module level finds it."""
    imported: list[object] = []
    for spec in modules:
        name, _, attribute = spec.partition(":")
        module = import_with_stubs(name, packages, strict=strict).module
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
