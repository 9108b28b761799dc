"""The 60-line bound(docs/writing-an-adapter.md, "The 60-line bound"): the guide's worked adapter and
every registered third-party adapter module count at most 60 lines.

The count (:func:`adapter_lines`): the lines that hold Python code, at least one token other than a comment. A
blank line, a comment-only line and the lines of a docstring (the first statement of a module, class or function
when it is a string) do not count; a statement over several lines counts each line. The records module beside an
adapter in its folder (``records.py``) is a separate module and not counted; the kit (``spec/engines/kit/``) is
not the adapter. Third-party adapters: every engine of :data:`spec.run.registry.ENGINES` but impl
and verl's (``verl``, ``verl-*``), whose adapters probe a whole framework.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from spec.run.registry import ENGINES

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "writing-an-adapter.md"
BOUND = 60
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def adapter_lines(source: str) -> int:
    """The number of lines of ``source`` that count (the module docstring's rule above)."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _SKIPPED:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def third_party_modules() -> dict[str, Path]:
    """Registered engine name -> the module file of its adapter class."""
    return {name: Path(inspect.getsourcefile(make)) for name, (make, _) in ENGINES.items()
            if name != "impl" and name != "verl" and not name.startswith("verl-")}


def guide_adapter() -> str:
    (code,) = re.findall(r"```python\n# mypkg/adapter\.py\n(.*?)```", GUIDE.read_text(), re.S)
    return code


def test_the_count() -> None:
    source = '''"""A module docstring
    over two lines."""
    import torch  # a comment after code counts

    # a comment alone does not


    class A:
        """One line."""

        def f(self, x):
            """Two
            lines."""
            return {"a": x,
                    "b": "not a docstring"}
    '''
    assert adapter_lines(source.replace("\n    ", "\n")) == 5  # import, class, def, and the two-line return


def test_the_guide_example_fits() -> None:
    count = adapter_lines(guide_adapter())
    assert count <= BOUND, f"the guide's mypkg/adapter.py counts {count} lines, above {BOUND}"
    stated = re.search(r"(\d+) lines by \[the count\]", GUIDE.read_text())
    assert stated and int(stated.group(1)) == count, "the guide states another count for its adapter"


def test_third_party_adapters_are_found() -> None:
    modules = third_party_modules()
    assert {"trl", "trl-fused", "openrlhf", "skyrl-train", "skyrl"} <= set(modules)
    assert not any(path.name == "records.py" or "kit" in path.parts for path in modules.values())


@pytest.mark.parametrize("name, path", sorted(third_party_modules().items()))
def test_each_third_party_adapter_fits(name, path) -> None:
    count = adapter_lines(path.read_text())
    assert count <= BOUND, f"engine {name}: {path.relative_to(ROOT)} counts {count} lines, above {BOUND}"
