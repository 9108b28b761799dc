"""Vendoring: a real module's source as a standalone file carries it.

A reproducer (``spec/repro``) and an engine's reproducer snippet (:class:`~spec.protocol.engine.ReproSnippet`) are
made of code that lives in real modules of this project, importable and checked by tests
(``tests/test_vendored.py``: each imports only the standard library, numpy, torch and tensordict, and reads no name
but its own, a builtin's, or one it declares in ``BOUND``); the writer copies their source into the file it writes
(:func:`source`), so that no program is kept in a string. What differs per file (a case, an engine's module name)
is bound by plain assignments written before the vendored source (:func:`assignments`).

Imports nothing of the suite.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["source", "definitions", "assignments", "literal", "bound"]


def _path(module: ModuleType | str) -> Path:
    return Path(importlib.util.find_spec(module).origin if isinstance(module, str) else inspect.getsourcefile(module))


def _without(text: str, drop) -> str:
    """``text`` without the lines of the top-level statements ``drop`` picks, leading blank lines stripped."""
    lines = text.splitlines()
    gone = {i for node in ast.parse(text).body if drop(node) for i in range(node.lineno - 1, node.end_lineno)}
    kept = [line for i, line in enumerate(lines) if i not in gone]
    while kept and not kept[0].strip():
        kept.pop(0)
    return "\n".join(kept).rstrip() + "\n"


def _docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def source(module: ModuleType | str, *, future: bool = False) -> str:
    """``module``'s source as a file carries it: a comment naming where it comes from, then the source without its
    docstring and (unless ``future``: the vendored text opens the file) its ``from __future__`` import, which only a
    file's first statement may be; everything else as it is. ``module`` by name is read from its file, not imported
    (an engine's snippet module imports the engine's package)."""
    path = _path(module)
    dotted = module if isinstance(module, str) else module.__name__
    name = dotted.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
    text = path.read_text()
    first = ast.parse(text).body[0].lineno
    body = _without(text, lambda node: (_docstring(node) and node.lineno == first) or (
        isinstance(node, ast.ImportFrom) and node.module == "__future__" and not future))
    return f"# ---- {name}, vendored (its source as it is in this project) ----\n" + body


def definitions(module: ModuleType) -> str:
    """``module``'s definitions, for a file that joins several modules' into one namespace (a reproducer's
    ``repro_suite.py``): its source without its docstring, imports and ``__all__`` (the joined file imports what they
    import, and binds the names they take from the suite's other modules by writing those out too)."""
    def drop(node: ast.stmt) -> bool:
        return _docstring(node) or isinstance(node, (ast.Import, ast.ImportFrom)) or (
            isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets))
    return _without(_path(module).read_text(), drop)


def literal(value: Any) -> str:
    """``repr`` that reads back as the same value (a non-finite float as ``float('nan')``, tuples and lists item by
    item)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, tuple):
        return "(" + "".join(literal(v) + ", " for v in value) + ")"
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


def assignments(values: dict[str, Any], comments: dict[str, str] | None = None) -> str:
    """One assignment line per name: what a file binds before a vendored module that reads it (its ``BOUND``)."""
    comments = comments or {}
    return "".join(f"{name} = {literal(value)}" + (f"  # {comments[name]}" if name in comments else "") + "\n"
                   for name, value in values.items())


def bound(module: ModuleType) -> tuple[str, ...]:
    """The names ``module`` declares a file binds for it (its ``BOUND``; none declared: ``()``)."""
    return tuple(getattr(module, "BOUND", ()))
