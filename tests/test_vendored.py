"""The modules a reproducer carries (vendored: spec/protocol/vendor.py copies their source into the file) are real,
linted code: each imports only the standard library, numpy, torch and tensordict (and the package its engine block
builds from: impl, verl; the suite guard, the suite), reads no name but its own, a builtin's, or one it declares in
``BOUND`` (what the file binds before it), declares none it does not read, and imports without doing anything where
its packages are installed. And the text a file carries is the module's source, docstring aside.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from spec.protocol import vendor
from tests.test_repro_runtime import _free_names

ROOT = Path(__file__).resolve().parents[1]
VENDORED = sorted(p for p in (ROOT / "spec/repro/vendored").glob("*.py") if p.name != "__init__.py")
SNIPPETS = [ROOT / "spec/engines/impl/repro_snippet.py", ROOT / "spec/engines/kit/factory_repro.py",
            ROOT / "spec/engines/verl/repro_snippet.py", ROOT / "spec/engines/verl/repro_processor.py",
            ROOT / "spec/protocol/adapter_repro.py"]
#: the package a module's code builds the engine from (beyond torch, tensordict, numpy and the standard library), by
#: the module's path
ENGINE_PACKAGE = {"spec/engines/impl/repro_snippet.py": {"impl"}, "spec/repro/vendored/planted_engine.py": {"impl"},
                  "spec/engines/verl/repro_snippet.py": {"verl"}, "spec/engines/verl/repro_processor.py": {"verl"},
                  "spec/repro/vendored/suite_guard.py": {"spec"}}


def _package(path: Path) -> set[str]:
    return ENGINE_PACKAGE.get(path.relative_to(ROOT).as_posix(), set())


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _imports(tree: ast.Module) -> tuple[set[str], list[ast.ImportFrom]]:
    found = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    found |= {node.module.split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    return found, [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]


def _bound(tree: ast.Module) -> tuple[str, ...]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["BOUND"]:
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("no BOUND declared")


@pytest.mark.parametrize("path", VENDORED + SNIPPETS, ids=lambda p: p.relative_to(ROOT).with_suffix("").as_posix())
def test_a_vendored_module_is_linted_code(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported, relative = _imports(tree)
    allowed = set(sys.stdlib_module_names) | {"torch", "tensordict", "numpy"} | _package(path)
    assert not relative and imported <= allowed, sorted(imported - allowed)
    bound = set(_bound(tree))
    free = _free_names(tree) - {"__file__"}
    assert free <= bound, f"reads {sorted(free - bound)} without declaring them in BOUND"
    assert bound <= free, f"declares {sorted(bound - free)} in BOUND without reading them"


@pytest.mark.parametrize("path", VENDORED + SNIPPETS, ids=lambda p: p.relative_to(ROOT).with_suffix("").as_posix())
def test_a_vendored_module_imports_where_its_packages_are(path: Path) -> None:
    packages = _package(path) - {"spec"}
    if any(importlib.util.find_spec(p) is None for p in packages):
        pytest.skip(f"{sorted(packages)} not installed")
    module = importlib.import_module(_module(path))
    assert vendor.bound(module) == _bound(ast.parse(path.read_text()))


@pytest.mark.parametrize("path", VENDORED + SNIPPETS, ids=lambda p: p.relative_to(ROOT).with_suffix("").as_posix())
def test_the_vendored_text_is_the_modules_source(path: Path) -> None:
    """What a file carries: a comment naming the module, then its source with the docstring and the ``from
    __future__`` import left out, every other line as it is and compiling."""
    text = vendor.source(_module(path))
    first, _, rest = text.partition("\n")
    assert first == f"# ---- {path.relative_to(ROOT)}, vendored (its source as it is in this project) ----"
    assert "from __future__" not in rest and rest.strip() in path.read_text()
    compile(text, str(path), "exec")
    assert vendor.source(_module(path), future=True).count("from __future__ import annotations") == 1
