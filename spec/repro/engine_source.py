"""A planted engine written out: its module's source, over impl imported, so a reproducer runs without the suite.

A planted engine (:class:`spec.planted.PlantedEngine`) is impl with one mistake, its ``lm`` / ``value`` classes
subclasses of impl's defined in a module of ``spec/planted``. :func:`planted_engine_snippet` writes that module
and every module of the suite it imports into the file, each as a module of its own under a private name
(``_written_spec_planted_engine_bugs``, ...; its imports of the suite rewritten to those names, so the process's own
``spec``, where importable, is neither used nor replaced); impl itself is imported (``pip install rl-ioprep``), and
``make_engine`` / ``helper`` are bound to them as impl's snippet binds them to impl. A bug that is more than an engine
class, a padding helper or its own companion (a planted processor class's classmethod, the file's
``logits_processor``), behind a configuration switch or a declared precision or not (neither changes how the engine
is built), say a micro-batch layer or packer, or a module that imports the suite otherwise, gets None: the engine
keeps its own snippet.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys

from ..planted import PlantedEngine
from ..protocol.engine import ReproSnippet
from ..protocol.vendor import source
from .imports import alias, modules_code
from .vendored import own_processor, planted_engine

__all__ = ["planted_engine_snippet", "written_modules"]

#: the top-level packages whose modules are written out (the suite's) and imported (the engine it plants bugs in)
WRITTEN, IMPORTED = ("spec",), "impl"

#: a relative import, one line or parenthesized over several
_RELATIVE = re.compile(r"^from\s+(\.+[\w.]*)\s+import\s+(\([^)]*\)|[^\n]+)$", re.MULTILINE)
#: ``from impl.x import ...`` / ``from spec.x import ...``, one line or parenthesized
_FROM = re.compile(r"^from\s+((?:spec|impl)(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]+)$", re.MULTILINE)
#: ``import impl`` / ``import impl.x`` (a bare name of a written package)
_IMPORT = re.compile(r"^import\s+((?:spec|impl)(?:\.\w+)*)\s*$", re.MULTILINE)
#: anything else importing the suite (``import spec as x``, a nested import): not written out
_OTHER = re.compile(r"^\s*(from\s+\.|from\s+spec\b|import\s+spec\b)", re.MULTILINE)


def _top(module: str) -> str:
    return module.split(".")[0]


def written_modules(name: str, done: dict[str, str] | None = None, visiting: frozenset[str] = frozenset()
                    ) -> tuple[dict[str, str] | None, str | None]:
    """``{alias: source}`` writing out module ``name`` (of :data:`WRITTEN`) and every module of those packages it
    imports, dependencies first, each import rewritten to the alias; ``(None, why)`` where one cannot be."""
    done = {} if done is None else done
    if alias(name) in done:
        return done, None
    if name in visiting:
        return None, f"{name} is imported in a cycle"
    module = sys.modules.get(name)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None, f"the source of {name} is not available"
    package = module.__package__ if module.__package__ is not None else name.rpartition(".")[0]

    targets: list[str] = []

    def relative(match: re.Match) -> str:
        target = importlib.util.resolve_name(match.group(1), package)
        if _top(target) == IMPORTED:
            return f"from {target} import {match.group(2)}"
        targets.append(target)
        return f"from {alias(target)} import {match.group(2)}"

    def absolute(match: re.Match) -> str:
        if _top(match.group(1)) == IMPORTED:
            return match.group(0)
        targets.append(match.group(1))
        return f"from {alias(match.group(1))} import {match.group(2)}"

    def bare(match: re.Match) -> str:
        target = match.group(1)
        if _top(target) == IMPORTED:
            return match.group(0)
        if "." in target:  # ``import impl.x`` binds ``impl``: only the package itself is written this way
            targets.append("")
            return match.group(0)
        targets.append(target)
        return f"import {alias(target)} as {target}"

    source = _RELATIVE.sub(relative, source)
    source = _FROM.sub(absolute, source)
    source = _IMPORT.sub(bare, source)
    if "" in targets or _OTHER.search(source):
        return None, f"{name} imports {' or '.join(WRITTEN)} in a way not written out"
    if _top(name) == IMPORTED:
        return None, f"{name} is impl's, imported rather than written out"
    for target in targets:
        if target in (name, "") or _top(target) not in WRITTEN or target not in sys.modules:
            return None, f"{name} imports {target or '?'}, which is not written out"
        _, why = written_modules(target, done, visiting | {name})
        if why:
            return None, why
    done[alias(name)] = source
    return done, None


def planted_engine_snippet(engine: object) -> ReproSnippet | None:
    """impl's snippet for a planted engine whose bug is its ``lm`` / ``value`` class or a padding helper it hands out
    (``helper(name)``), that class's or helper's module and impl written out into the file; None for any other
    engine or bug."""
    bug = getattr(engine, "bug", None)
    companion = getattr(bug, "companion", None)
    if not isinstance(engine, PlantedEngine) or bug is None or not (bug.lm or bug.value or bug.helpers or companion) \
            or any((bug.microbatch, bug.packer)):  # a switch or a declared precision builds as it is
        return None
    modules: dict[str, str] = {}
    imported: set[str] = {IMPORTED}

    def ref(obj: object) -> str | None:  # the written-out name of a class or function of the suite, impl's imported
        nonlocal modules
        module, qual = getattr(obj, "__module__", ""), getattr(obj, "__qualname__", "")
        if "<" in qual or "." in qual:
            return None
        if _top(module) == IMPORTED:
            imported.add(module)
            return f"{module}.{qual}"
        if _top(module) not in WRITTEN:
            return None
        modules, why = written_modules(module, modules)
        return None if why else f"{alias(module)}.{qual}"

    classes = {head: ref(cls) for head, cls in engine.engine_classes.items()}
    helpers = {name: ref(fn) for name, fn in bug.helpers}
    # an own companion (a classmethod of a planted processor class): the file's logits_processor(case, sp_size, sp_rank)
    owner = getattr(companion, "__self__", None)
    own = None if companion is None else (ref(owner) if isinstance(owner, type) else None)
    if None in classes.values() or None in helpers.values() or (companion is not None and own is None):
        return None
    code = "\n".join([
        *(f"import {module}" for module in sorted(imported)), "",
        "# the planted engine's module, written out (its own module under a private name) over impl imported",
        *modules_code(modules), "",
        "_CLASSES = {" + ", ".join(f"{head!r}: {r}" for head, r in classes.items()) + "}",
        "_HELPERS = {" + ", ".join(f"{name!r}: {r}" for name, r in helpers.items()) + "}  # the planted ones", "", "",
        # the companion's switches configure the processor, not the engine (as PlantedEngine.make drops them)
        "_PROCESSOR_SWITCHES = " + repr(tuple(sw.name for sw in bug.config) if companion is not None else ()), "", "",
        source(planted_engine),
        *([] if own is None else [f"_OWN_PROCESSOR = {own}.{companion.__name__}", "", source(own_processor)])])
    return ReproSnippet(code, requires="rl-ioprep", standalone=True)
