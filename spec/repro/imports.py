"""How a standalone reproducer gets hold of an engine's own function, and the suite's checks it writes out.

:func:`function_imports`: an ``import`` line per function defined at module level outside the suite (the engine's
package, impl, a user's module); a function the suite itself defines in a module that imports nothing of the
suite (the planted padding helpers: ``spec/planted/helper_bugs.py``, ``dropin_bugs.py``) gets that module's whole
source written into the file and run as a module of its own; anything else (a closure, a lambda, a function of a
suite module that imports the suite) is not standalone, and the reason says which.

:func:`written_out`: the source of the suite's check functions and every module-level function and constant they
reach, for a reproducer to run the invariant's own check (its decorators dropped).
"""

from __future__ import annotations

import inspect
import re
import types
from typing import Any, Callable, Iterable

__all__ = ["function_imports", "written_out"]

_SUITE_IMPORT = re.compile(r"^\s*(from\s+\.|from\s+spec\b|import\s+spec\b)", re.MULTILINE)


def _suite(module: str) -> bool:
    return module.split(".")[0] in ("spec", "__main__")


def function_imports(functions: dict[str, Callable[..., Any] | None]) -> tuple[str | None, str | None]:
    """Code binding each name to its function (``None``: not importable, then why)."""
    lines, inlined = [], {}
    for name, fn in functions.items():
        fn = inspect.unwrap(fn) if fn is not None else None  # an adapter's shim (verl's CPU collectives, dense mask)
        module, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if fn is None or module is None or "<" in qual or "." in qual:
            return None, f"the engine's {name} is not a module-level function ({qual or fn!r})"
        if not _suite(module):
            lines.append(f"from {module} import {qual} as {name}")
            continue
        try:
            source = inspect.getsource(inspect.getmodule(fn))
        except (OSError, TypeError):
            source = ""
        if not source or _SUITE_IMPORT.search(source):
            return None, f"the engine's {name} is defined by the suite ({module}.{qual}), in a module that imports it"
        alias = "_" + module.replace(".", "_")
        if alias not in inlined:
            inlined[alias] = source
            lines.append(f"{alias} = _module({module!r}, {source!r})")
        lines.append(f"{name} = {alias}.{qual}")
    if inlined:
        lines.insert(0, "def _module(name, source):  # the suite's own definition, written out (it imports nothing "
                        "of the suite)\n    import types\n    mod = types.ModuleType(name)\n"
                        "    exec(compile(source, name, 'exec'), mod.__dict__)\n    return mod\n\n")
    return "\n".join(lines), None


def _body(fn: Callable[..., Any]) -> str:
    """``fn``'s source from its ``def`` line (decorators dropped)."""
    lines = inspect.getsource(fn).splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    return "\n".join(lines[start:]) + "\n"


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def written_out(checks: Iterable[Callable[..., Any]], provided: Iterable[str]) -> tuple[str | None, str | None]:
    """The source of ``checks`` and of the suite's module-level functions and plain constants they reach by name
    (``provided``: names the file defines itself); ``(None, why)`` when one of them reaches something else of the
    suite (a class, an object) that cannot be written out."""
    provided = set(provided)
    seen: dict[str, str] = {}
    constants: dict[str, str] = {}
    todo = list(checks)
    while todo:
        fn = todo.pop()
        if fn.__name__ in seen:
            continue
        seen[fn.__name__] = _body(fn)
        for name in sorted(n for n in _names(fn.__code__) - provided if not n.startswith("__")):
            obj = fn.__globals__.get(name)
            if obj is None or isinstance(obj, types.ModuleType):
                continue
            if inspect.isfunction(obj) and _suite(obj.__module__):
                todo.append(obj)
            elif isinstance(obj, (bool, int, float, str)) or (isinstance(obj, tuple) and all(
                    isinstance(x, (bool, int, float, str)) for x in obj)):
                constants[name] = repr(obj)
            elif _suite(getattr(obj, "__module__", "") or ""):
                return None, f"{fn.__name__} reaches the suite's {name} ({type(obj).__name__}), not written out"
    head = "".join(f"{name} = {value}\n" for name, value in sorted(constants.items()))
    return head + "\n\n" + "\n\n".join(reversed(list(seen.values()))), None
