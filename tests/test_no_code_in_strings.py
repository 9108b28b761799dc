"""Code is code: no program is kept in a string literal anywhere in spec/. What a reproducer or an engine's snippet
carries is vendored from real modules (spec/protocol/vendor.py, spec/repro/vendored/, each engine folder's repro_snippet module),
which tests/test_vendored.py lints.

A string literal (an f-string read with each placeholder as a name) holds a program when

* it has 8 or more lines and holds ``\\ndef `` or ``\\nimport ``, or starts with ``def `` or ``import `` (the rule of
  the project's before-stop hook);
* it has two or more non-blank lines and parses as Python holding a statement other than a bare name or constant
  (an import, a definition, an assignment, a call, a loop, a branch): prose and messages do not parse, a docstring
  is prose;
* it is a one-line ``def`` header (a function written out line by line: ``"def f(x):"``; a bare ``class C:``
  header wrapping code the suite compiles, spec/execute/probe.py's mutant methods, is not one).

The test failed on the tree before spec/repro/vendored/ (23 literals by the hook's rule, 1,064 lines; 30 by the
parse rule).
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "spec"

_HEADER = re.compile(r"^\s*(async\s+)?def\s+\w+\s*\(.*\)\s*(->.*)?:")


def _text(node: ast.AST) -> str | None:
    """A literal's text (an f-string's placeholders as a name), or None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "_x_" for v in node.values)
    return None


def _parses_as_program(text: str) -> bool:
    if sum(1 for line in text.splitlines() if line.strip()) < 2:
        return False
    try:
        tree = ast.parse(textwrap.dedent(text))
    except (SyntaxError, ValueError):
        return False
    return any(not (isinstance(s, ast.Expr) and isinstance(s.value, (ast.Constant, ast.Name))) for s in tree.body)


def holds_program(text: str) -> bool:
    hook = text.count("\n") >= 8 and ("\ndef " in text or "\nimport " in text or text.startswith(("def ", "import ")))
    return hook or _parses_as_program(text) or bool(_HEADER.match(text) and "\n" not in text.strip())


def programs_in_strings(root: Path = SPEC) -> list[str]:
    """``path:line (n lines)`` of every string literal under ``root`` that holds a program."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
        for node in ast.walk(tree):
            text = None if id(node) in parts else _text(node)
            if text is not None and holds_program(text):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} ({text.count(chr(10)) + 1} lines)")
    return found


def test_no_program_is_kept_in_a_string_in_spec() -> None:
    assert programs_in_strings() == []


def test_the_rule_finds_programs_and_passes_prose() -> None:
    """Each rule catches what it is for, and messages, docstrings and one-line code fragments pass."""
    program = "import os\n\n\ndef f(x):\n    return x\n"
    assert holds_program(program)
    assert holds_program("x = 1\nprint(x)\n")
    assert holds_program("def make_engine(head, **settings):")
    assert holds_program("def f():\n" + "    pass\n" * 9)
    assert holds_program("def logits_processor(case, sp_size, sp_rank):  # the engine's own")
    for prose in ("The engine is wrong on this case.\nExit 1: got vs expected.",
                  "What the suite saw: got 1, expected 2",
                  "from {module} import {name} as _build",  # one generated line binding the engine's function
                  "rank 0: output 'log_probs' holds 3 tokens\n(offsets [0, 3])",
                  "Returns\n-------\nthe value"):
        assert not holds_program(prose), prose


def test_an_f_string_program_is_found(tmp_path) -> None:
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "m.py").write_text('NAME = "x"\nCODE = f"import {NAME}\\nprint({NAME})\\n"\n')
    assert programs_in_strings(tmp_path / "spec") == ["spec/m.py:2 (3 lines)"]
