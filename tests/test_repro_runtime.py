"""The reproducer's runtime is code (spec/repro/runtime.py), copied beside every engine-case file; the files are
short, say what they need, exit as their header says, and compare the key their invariant asserts.

Each test fails on the tree before the runtime was a module: the runtime was a string (spec/repro/templates.py's
RUNTIME), every file held it and the suite's pieces (1,800 lines for a 2-token case), INV-MB-015's file imported
the suite and exited 1 without it, and INV-VAL-003's file failed on ``log_probs``.
"""

from __future__ import annotations

import ast
import builtins
import os
import shutil
import subprocess
import sys
from pathlib import Path

from spec.cases.microbatch import MiniBatchCase
from spec.cases.structure import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.planted import planted_engine
from spec.repro import runtime, write_reproducer
from spec.repro.templates import RUNTIME_NAME, SUITE_NAME

from spec.run.registry import load_engine

from tests.planted_repro import AdapterOnly

ROOT = Path(__file__).resolve().parents[1]

#: runs each file given with the packages named in argv[1] (comma-separated) unimportable: "EXIT <code> <path>"
RUN_BLOCKED = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # any import of it fails
for path in sys.argv[2:]:
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    print("EXIT", code, path, flush=True)
"""


def _run_blocked(blocked: str, *paths: Path) -> tuple[dict[str, int], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKED, blocked, *map(str, paths)], capture_output=True,
                          text=True, env=env, cwd=str(paths[0].parent), timeout=600)
    codes = {line.split()[2]: int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("EXIT")}
    return codes, done.stdout + done.stderr


def _free_names(tree: ast.AST) -> set[str]:
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.alias):
            defined.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            defined.add(node.name)
    notes = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    notes += [n.returns for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.returns]
    in_notes = {id(sub) for note in notes for sub in ast.walk(note)}
    read = {node.id for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in in_notes}
    return read - defined


def test_the_runtime_imports_only_torch_tensordict_numpy_and_the_standard_library() -> None:
    tree = ast.parse(Path(runtime.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    relative = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level]
    assert not relative and imported - set(sys.stdlib_module_names) <= {"torch", "tensordict", "numpy"}, imported


def test_the_runtime_reads_only_its_own_names_and_those_it_declares_bound() -> None:
    """Its lint: every name it reads is its own, a builtin, or declared in BOUND (what the file binds by share)."""
    free = _free_names(ast.parse(Path(runtime.__file__).read_text()))
    assert free <= set(runtime.BOUND), sorted(free - set(runtime.BOUND))
    assert set(runtime.BOUND) <= free | {"view_inputs", "view_outputs", "logits_processor"}, \
        sorted(set(runtime.BOUND) - free)  # no stale declaration


def test_the_runtime_imports_with_neither_spec_nor_impl(tmp_path) -> None:
    copy = tmp_path / f"{RUNTIME_NAME}.py"
    shutil.copyfile(runtime.__file__, copy)
    probe = (f"import sys\nsys.modules['spec'] = sys.modules['impl'] = None\nsys.path.insert(0, {str(tmp_path)!r})\n"
             f"import {RUNTIME_NAME} as r\nassert callable(r.main) and callable(r.share) and 'values' in r.CHECKS\n"
             "print('imported')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=300)
    assert done.returncode == 0 and "imported" in done.stdout, done.stdout + done.stderr


def test_a_tiny_case_gives_a_short_file_beside_its_runtime(tmp_path) -> None:
    """A 2-token case: the file holds the case, the engine and the check (impl imported), under 300 lines; the
    runtime and the suite's pieces lie beside it, the runtime a byte copy of spec/repro/runtime.py."""
    case = EngineCase((2,), (1,), temperature=0.5)
    for name, engine in (("twin", ImplEngine()), ("planted", planted_engine("double_temperature"))):
        path, why = write_reproducer(tmp_path / f"{name}.py", invariant="INV-VAL-001", mode="packed", engine=engine,
                                     case=case)
        assert why is None
        text = path.read_text()
        assert len(text.splitlines()) < 300, (name, len(text.splitlines()))
        assert "import impl" in text and "Needs: pip install rl-ioprep torch tensordict" in text, name
    assert (tmp_path / f"{RUNTIME_NAME}.py").read_bytes() == Path(runtime.__file__).read_bytes()
    assert (tmp_path / f"{SUITE_NAME}.py").exists()
    codes, out = _run_blocked("spec", tmp_path / "twin.py", tmp_path / "planted.py")
    assert codes == {str(tmp_path / "twin.py"): 0, str(tmp_path / "planted.py"): 1}, out


def test_the_file_and_what_lies_beside_it_define_every_name_they_read(tmp_path) -> None:
    path, why = write_reproducer(tmp_path / "x.py", invariant="INV-VAL-001", mode="packed", engine=ImplEngine(),
                                 case=EngineCase((2,), (1,)))
    assert why is None
    assert not _free_names(ast.parse((tmp_path / f"{SUITE_NAME}.py").read_text()))
    free = _free_names(ast.parse(path.read_text()))  # the runtime's own names reach the file by share
    assert free <= runtime.OWN | {"__file__"}, sorted(free - runtime.OWN)


def test_a_file_whose_engine_needs_the_suite_exits_2_without_it(tmp_path) -> None:
    """INV-MB-015 on an engine built through its adapter (the default snippet imports the suite): its Needs names the
    distribution, rl-ioprep, and without the suite the file says it is not standalone and exits 2, not 1."""
    case = MiniBatchCase((3, 2), (2, 1), max_token_len=8)
    path, why = write_reproducer(tmp_path / "e2e.py", invariant="INV-MB-015", mode="packed", engine=AdapterOnly(),
                                 case=case)
    assert why is None, why
    text = path.read_text()
    header = text.split('"""')[1]
    needs = next(line for line in header.splitlines() if line.startswith("Needs:"))
    assert "rl-ioprep" in needs and " spec" not in needs, needs
    codes, out = _run_blocked("spec", path)
    assert codes == {str(path): 2} and "NOT STANDALONE" in out, out
    codes, out = _run_blocked("_nothing_", path)  # with the suite it runs: impl is right
    assert codes == {str(path): 0}, out


def test_a_value_invariants_file_checks_its_own_key(tmp_path) -> None:
    """INV-VAL-003 (sum_pi_squared) on an engine wrong on sum_pi_squared and log_probs alike: the file fails on
    sum_pi_squared, the key the invariant asserts (it compared every key, log_probs first)."""
    case = EngineCase((3,), (2,), calculate_sum_pi_squared=True, temperature=0.5)
    path, why = write_reproducer(tmp_path / "v3.py", invariant="INV-VAL-003", mode="packed",
                                 engine=load_engine("tests.repro_engines:wrong_keys"), case=case)
    assert why is None
    codes, out = _run_blocked("spec", path)
    assert codes == {str(path): 1}, out
    fail = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert "'sum_pi_squared'" in fail and "log_probs" not in fail, fail
