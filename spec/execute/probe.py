"""What a measurement asks of every process that runs engine code, the real ranks included: run a mutant of one
function of the engine's surface instead of the function (``spec mutate``), and which target's examples the
engine-code coverage is measuring now (the coverage map's dynamic context).

The parent sets both here (:func:`set_mutant`, :func:`set_context`); :meth:`spec.execute.ranks.RankPool.submit`
sends :func:`current` with every task, and each rank applies it (:func:`apply`) before it runs the task, so a
mutant runs on the ranks as it runs in the parent. A function is swapped by its ``__code__`` (the module is not
re-imported, every reference to the function sees the mutant) and swapped back when the mutant changes.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

from . import coverage_hook

__all__ = ["Mutation", "install", "set_mutant", "set_context", "current", "apply"]

#: a mutant as a process installs it: (module, qualified function name, the mutated function's source)
Mutation = tuple[str, str, str]

_WANTED: dict[str, Any] = {"mutant": None, "context": None}
#: this process's installed mutant: (the Mutation, its undo)
_INSTALLED: list[tuple[Mutation, Callable[[], None]]] = []


def _function_object(module: str, qualname: str) -> Any:
    obj = sys.modules[module] if module in sys.modules else importlib.import_module(module)
    for part in qualname.split("."):
        obj = obj.__dict__[part] if hasattr(obj, "__dict__") and part in obj.__dict__ else getattr(obj, part)
    return getattr(obj, "__func__", obj)


def install(mutation: Mutation) -> Callable[[], None]:
    """Swap the mutated function's code into the live function ``module:qualname``; returns the undo. The source is
    compiled in the module's namespace (a method inside a stand-in class, so ``super()``-free methods compile)."""
    module, qualname, source = mutation
    fn = _function_object(module, qualname)
    owner = "." in qualname
    body = source if not owner else "class _Owner:\n" + "\n".join("    " + line for line in source.splitlines())
    namespace = dict(vars(sys.modules[module]))
    exec(compile(body, f"<mutant {module}:{qualname}>", "exec"), namespace)  # noqa: S102 - the mutant's own code
    name = qualname.rsplit(".", 1)[-1]
    new = namespace["_Owner"].__dict__[name] if owner else namespace[name]
    new = getattr(new, "__func__", new)
    old = fn.__code__
    fn.__code__ = new.__code__
    return lambda: setattr(fn, "__code__", old)


def set_mutant(mutation: Mutation | None) -> None:
    """The mutant every process runs from now on (None: the engine's own code); installed here at once."""
    _WANTED["mutant"] = mutation
    apply(current())


def set_context(context: str | None) -> None:
    """The coverage context (a target's ``invariant/mode``) this process measures under from now on, and the ranks
    from their next task on."""
    _WANTED["context"] = context
    if context:
        coverage_hook.switch(context)


def current() -> dict[str, Any] | None:
    """What a task carries to the ranks (None when nothing is asked: the tasks of a plain run are unchanged)."""
    return dict(_WANTED) if any(_WANTED.values()) else None


def apply(wanted: dict[str, Any] | None) -> None:
    """In a process about to run engine code: install the mutant ``wanted`` names (undoing another first), or
    none; switch the coverage context."""
    mutation = (wanted or {}).get("mutant")
    mutation = tuple(mutation) if mutation is not None else None
    if _INSTALLED and _INSTALLED[0][0] != mutation:
        _INSTALLED.pop()[1]()
    if mutation is not None and not _INSTALLED:
        _INSTALLED.append((mutation, install(mutation)))  # type: ignore[arg-type]
    context = (wanted or {}).get("context")
    if context:
        coverage_hook.switch(context)
