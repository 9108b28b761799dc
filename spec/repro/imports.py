"""How a standalone reproducer gets hold of an engine's own function, and the suite's checks it writes out.

:func:`function_imports`: an ``import`` line per function defined at module level outside the suite (the engine's
package, impl, a user's module); a function the suite itself defines in a module that imports nothing of the
suite (the planted padding helpers: ``spec/planted/helper_bugs.py``, ``dropin_bugs.py``) gets that module's whole
source written into the file and run as a module of its own; anything else (a closure, a lambda, a function of a
suite module that imports the suite) is not standalone, and the reason says which.

:func:`written_out`: the source of the suite's check functions and every module-level function and constant they
reach, and an import line for each module or object outside the suite they reach, for a reproducer to run the
invariant's own check (its decorators dropped; a helper class of the suite written out whole).
"""

from __future__ import annotations

import __future__
import importlib.util
import inspect
import re
import sys
import textwrap
import types
from typing import Any, Callable, Iterable

from ..protocol.vendor import literal
from ..protocol.vendor import source as vendored_source
from .vendored import written_modules

__all__ = ["alias", "function_imports", "factory_layer_imports", "inline_module", "modules_code", "written_out"]

_SUITE_IMPORT = re.compile(r"^\s*(from\s+\.|from\s+spec\b|import\s+spec\b)", re.MULTILINE)


def _suite(module: str) -> bool:
    return module.split(".")[0] in ("spec", "__main__")


def alias(module: str) -> str:
    return "_written_" + module.replace(".", "_")


#: a relative import, on one line or parenthesised over several
_RELATIVE = re.compile(r"^from\s+(\.+[\w.]*)\s+import\s+(\([^)]*\)|[^()\n]+)$", re.MULTILINE)


def inline_module(name: str, done: dict[str, str] | None = None) -> tuple[dict[str, str] | None, str | None]:
    """``{alias: source}`` writing out the suite module ``name`` and the suite modules it imports (relative
    imports only, one line or parenthesised, rewritten to the aliases), dependencies first; ``(None, why)`` where one imports the
    suite otherwise."""
    done = {} if done is None else done
    module = sys.modules.get(name) or importlib.import_module(name)
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None, f"the source of {name} is not available"

    def absolute(match: re.Match) -> str:
        return importlib.util.resolve_name(match.group(1), module.__package__)

    for match in _RELATIVE.finditer(source):
        target = absolute(match)
        if alias(target) not in done:
            _, why = inline_module(target, done)
            if why:
                return None, why
    source = _RELATIVE.sub(lambda m: f"from {alias(absolute(m))} import {m.group(2)}", source)
    if _SUITE_IMPORT.search(source):
        return None, f"{name} imports the suite in a way not written out"
    done[alias(name)] = source
    return done, None


def modules_code(modules: dict[str, str]) -> list[str]:
    return [vendored_source(written_modules)] + [f"{alias} = _module({alias!r}, {source!r})"
                                                 for alias, source in modules.items()]


def function_imports(functions: dict[str, Callable[..., Any] | None]) -> tuple[str | None, str | None]:
    """Code binding each name to its function (``None``: not importable, then why)."""
    lines, modules = [], {}
    for name, fn in functions.items():
        fn = inspect.unwrap(fn) if fn is not None else None  # an adapter's shim (verl's CPU collectives, dense mask)
        module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if fn is None or module is None or "<" in qual or "." in qual:
            return None, f"the engine's {name} is not a module-level function ({qual or fn!r})"
        if not _suite(module):
            lines.append(f"from {module} import {qual} as {name}")
            continue
        _, why = inline_module(module, modules)
        if why:
            return None, f"the engine's {name} is defined by the suite ({module}.{qual}): {why}"
        lines.append(f"{name} = {alias(module)}.{qual}")
    return "\n".join((modules_code(modules) if modules else []) + lines), None


def factory_layer_imports(factory: Callable[..., Any], base: Any, names: Iterable[str]
                          ) -> tuple[str | None, str | None]:
    """Code binding ``names`` to the functions of ``factory(base)``: a ``layer -> layer`` factory the suite defines
    (a planted micro-batch bug) written out with the modules it imports, called on ``base``, a layer of the
    engine's own module-level functions (``layer_from`` over one module, rebuilt by that module's name)."""
    module = getattr(factory, "__module__", "") or ""
    qual = getattr(factory, "__qualname__", "")
    if not _suite(module) or "<" in qual or "." in qual:
        return None, f"the layer factory {qual or factory!r} is not a module-level function of the suite"
    sources = {getattr(fn, "__module__", None) for fn in base.functions.values()}
    package = {m.rsplit(".", 1)[0] for m in sources if m}
    if len(package) != 1 or any(m is None or _suite(m) for m in sources):
        return None, f"the layer {base.name!r} the factory wraps is not one package's module-level functions"
    modules, why = inline_module("spec.protocol.microbatch")
    if why:
        return None, why
    modules, why = inline_module(module, modules)
    if why:
        return None, why
    (pkg,) = package
    lines = modules_code(modules) + [
        f"import {pkg}",
        f"_LAYER = {alias(module)}.{qual}({alias('spec.protocol.microbatch')}.layer_from({base.name!r}, [{pkg}]))"]
    lines += [f"{name} = _LAYER.get({name!r})" for name in names]
    return "\n".join(lines), None


def _body(fn: Callable[..., Any]) -> str:
    """``fn``'s source from its ``def`` line (decorators dropped); a class's whole source (its decorators kept)."""
    if inspect.isclass(fn):
        return textwrap.dedent(inspect.getsource(fn))
    lines = inspect.getsource(fn).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return "\n".join(lines[start:]) + "\n"


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _reached(fn: Any) -> tuple[set[str], dict[str, Any]]:
    """The global names ``fn`` reads (a class: its whole body, decorators and bases included) and its globals."""
    if inspect.isclass(fn):
        code = compile(_body(fn), fn.__qualname__, "exec", flags=__future__.annotations.compiler_flag,
                       dont_inherit=True)  # annotations stay strings, as in the suite's modules
        return (_names(code) - {fn.__name__},
                vars(sys.modules[fn.__module__]))
    return _names(fn.__code__), fn.__globals__


def _plain(obj: Any) -> bool:
    return isinstance(obj, (bool, int, float, str)) or (isinstance(obj, tuple) and all(
        isinstance(x, (bool, int, float, str)) for x in obj))


def _import_line(name: str, obj: Any) -> str | None:
    """An import binding ``name`` to ``obj`` (a module, or an object its module exports by that name), or None."""
    if isinstance(obj, types.ModuleType):
        return f"import {obj.__name__}" + ("" if obj.__name__ == name else f" as {name}")
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "." in qual or getattr(sys.modules.get(module), qual, None) is not obj:
        return None
    return f"from {module} import {qual}" + ("" if qual == name else f" as {name}")


def written_out(checks: Iterable[Callable[..., Any]], provided: Iterable[str]) -> tuple[str | None, str | None]:
    """The source of ``checks`` and of the suite's module-level functions, classes and plain constants they reach by
    name (``provided``: names the file defines itself), with an import line for each module or importable object
    outside the suite they reach; ``(None, why)`` when one of them reaches something else of the suite (an object)
    that cannot be written out."""
    provided = set(provided)
    seen: dict[str, str] = {}
    constants: dict[str, str] = {}
    imports: dict[str, str] = {}
    aliases: dict[str, str] = {}  # a function or class imported under another name (``offsets as _offsets``)
    objects: dict[str, Any] = {}
    todo = list(checks)
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen[fn.__name__], objects[fn.__name__] = _body(fn), fn
        names, scope = _reached(fn)
        for name in sorted(n for n in names - provided if not n.startswith("__")):
            obj = scope.get(name)
            if obj is None:
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and _suite(obj.__module__):
                todo.append(obj)
                if name != obj.__name__:
                    aliases[name] = obj.__name__
            elif _plain(obj):
                constants[name] = literal(obj)
            elif _suite(getattr(obj, "__module__", "") or ""):
                return None, f"{fn.__name__} reaches the suite's {name} ({type(obj).__name__}), not written out"
            elif (line := _import_line(name, obj)) is not None:
                imports[name] = line
    head = "".join(f"{line}\n" for _, line in sorted(imports.items()))
    head += "".join(f"{name} = {value}\n" for name, value in sorted(constants.items()))
    tail = "".join(f"{name} = {target}\n" for name, target in sorted(aliases.items()))
    order: list[str] = []

    def place(name: str) -> None:  # a class after the suite's classes it derives from
        if name in order:
            return
        for base in getattr(objects[name], "__bases__", ()):
            if base.__name__ in objects and objects[base.__name__] is base:
                place(base.__name__)
        order.append(name)

    for name in reversed(list(seen)):
        place(name)
    body = "\n\n".join(seen[name] for name in order)
    return head + "\n\n" + body + ("\n\n" + tail if tail else ""), None
