"""A real engine's adapter carried in its reproducer as source, so that the file runs where only the engine's package
is installed (no suite, no hypothesis, no pytest: ``python -m spec.repro.fresh_env`` checks it).

Engines whose adapter has no written-out snippet (TRL, OpenRLHF, verl's TorchTitan, Automodel, VeOmni and Megatron
adapters) get :meth:`EngineUnderTest.repro_snippet`'s default, which imports the adapter. :func:`carried` writes the
adapter's module and every module of this project it imports (``spec.*`` and ``impl.*``, found by reading their
imports with ``ast``; package ``__init__`` files included) into the file as a dict of sources served by an import
hook placed first on ``sys.meta_path``: the same code the suite ran, nothing installed. Only adapters of
``spec.engines`` are carried (a planted engine or a user's module keeps the import, as its header says); a carried
module that imports hypothesis or pytest makes it return None (the file then imports the suite, as before).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

from ..protocol.engine import ReproSnippet
from ..protocol.vendor import source
from .vendored import carried_modules

__all__ = ["carried", "closure"]

ROOT = Path(__file__).resolve().parents[2]
#: the packages of this project a carried module may import (anything else must be installed)
PROJECT = ("spec", "impl")
#: what a carried module may not import: the suite's test dependencies, absent from a fresh environment
FORBIDDEN = ("hypothesis", "pytest")
#: what to pip install for each carried adapter (pinned to the versions installed when the file is written)
PACKAGES = {"spec.engines.trl.adapter": ("trl",), "spec.engines.openrlhf.adapter": ("openrlhf", "einops"),
            "spec.engines.veomni.adapter": ("verl", "veomni"), "spec.engines.megatron.adapter": ("verl", "megatron-core")}
#: the module a distribution installs, where it is not the distribution's name
MODULES = {"megatron-core": "megatron.core"}
#: how its CI step (spec/engines/<folder>/ci.sh) installs a carried adapter's package, where it is not a plain ``pip install`` (the header says so)
NO_DEPS = {"spec.engines.openrlhf.adapter": "openrlhf --no-deps: its heavy imports are stubbed; and flash-attn 2.8.3's "
                                     "pure-torch bert_padding.py as the module flash_attn_bert_padding, since flash-attn "
                                     "needs CUDA to build: `python .ci/steps/bert_padding.py` in rl-ioprep copies it",
           "spec.engines.veomni.adapter": "veomni --no-deps, as its CI step (spec/engines/veomni/ci.sh) installs it"}
_BUILD = re.compile(r"^from ([\w.]+) import (\w+) as _build$", re.MULTILINE)


def _file(module: str) -> tuple[Path | None, bool]:
    base = ROOT.joinpath(*module.split("."))
    if (base / "__init__.py").is_file():
        return base / "__init__.py", True
    return (base.with_suffix(".py"), False) if base.with_suffix(".py").is_file() else (None, False)


def _imports(module: str) -> set[str]:
    path, package = _file(module)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            found |= {target, *(f"{target}.{alias.name}" for alias in node.names)}
    return found


def closure(module: str) -> dict[str, tuple[bool, str]] | None:
    """``{name: (is_package, source)}`` for ``module``, its parent packages and every project module they import,
    transitively; None when one of them imports hypothesis or pytest."""
    todo, out = [module], {}
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            path, package = _file(mod)
            if path is None or mod in out:
                continue
            imported = _imports(mod)
            if any(i.split(".")[0] in FORBIDDEN for i in imported):
                return None
            out[mod] = (package, path.read_text())
            todo += [i for i in imported if i.split(".")[0] in PROJECT]
    return dict(sorted(out.items()))


def carried(snippet: ReproSnippet) -> ReproSnippet | None:
    """``snippet`` (the default, importing an adapter of ``spec.engines``) with that adapter carried as source; None
    where it is not such a snippet or the adapter cannot be carried."""
    match = _BUILD.search(snippet.code)
    if snippet.standalone or match is None or not match.group(1).startswith("spec.engines."):
        return None
    sources = closure(match.group(1))
    if sources is None:
        return None
    lines = sum(len(src.splitlines()) for _, src in sources.values())
    pins = _pins(match.group(1))
    installed = [(pin, MODULES.get(dist, dist.replace("-", "_"))) for dist, pin in pins if "==" in pin]
    code = "\n".join([
        source(carried_modules),
        "# first: the packages installed when the suite ran (its header's Needs, pinned), each findable; without one",
        "# the adapter would stub it (spec/engines/kit/stubs.py) and the file would run what the suite did not",
        f"_require_installed({installed!r})",
        f"# {match.group(1)} (the adapter) and the {len(sources) - 1} modules of this project it imports, carried as "
        f"source ({lines} lines): nothing of the suite need be installed",
        "_CARRIED = {", *(f"    {name!r}: ({package!r}, {src!r})," for name, (package, src) in sources.items()), "}",
        "_serve_carried()", "", snippet.code])
    return ReproSnippet(code, requires=_requires(match.group(1), pins), standalone=True)


def _pins(module: str) -> list[tuple[str, str]]:
    """(distribution, ``dist==version`` where installed now, else the bare name) for each package ``module`` wraps."""
    pins = []
    for dist in PACKAGES.get(module, ("verl",)):  # every other adapter of spec.engines wraps verl
        try:
            pins.append((dist, f"{dist}=={importlib.metadata.version(dist)}"))
        except importlib.metadata.PackageNotFoundError:
            pins.append((dist, dist))
    return pins


def _requires(module: str, pins: list[tuple[str, str]]) -> str:
    return " ".join(pin for _, pin in pins) + (f" ({NO_DEPS[module]})" if module in NO_DEPS else "")
