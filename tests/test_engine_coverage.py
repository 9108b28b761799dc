"""Engine-code coverage (spec/run/engine_coverage.py): the surface resolves to function bodies, coverage.py
measures its branches in this process and in worker processes, each unreached branch is listed with its reason or
flagged without one; and a registered engine's run leaves no branch of its surface unreached without a reason.

The impl run (``spec verify --engine impl --profile dev``, a few minutes on 2 cores) is run here; a real engine's
report is read from ``$ENGINE_COVERAGE_REPORTS`` (space-separated JSON reports ``spec verify`` wrote: the CI step
that ran the engine's verify sets it), skipped when unset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spec.run import engine_coverage
from spec.run.engine_coverage import Measurement, regions

pytest.importorskip("coverage")

ROOT = Path(__file__).resolve().parent.parent

TOY = '''\
CONSTANT = 1


def choose(x):
    if x > 0:
        return "positive"
    if x == 0:
        return "zero"
    return "negative"


class Cutter:
    def cut(self, rows, size):
        out = []
        for start in range(0, len(rows), size):
            out.append(rows[start:start + size])
        return out

    def needs_cuda(self, x):
        if x.is_cuda:
            return x
        return x


def check(x):
    if x is None:
        raise ValueError("x is None")
    return x
'''


@pytest.fixture()
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_engine_mod.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("toy_engine_mod", None)
    yield "toy_engine_mod"
    sys.modules.pop("toy_engine_mod", None)


def test_surface_is_function_bodies_and_names_what_is_missing(toy):
    found, missing = regions((toy, f"{toy}:Cutter.cut", f"{toy}:nothing_here", "no_such_module_x:f"))
    module, cut = found
    assert 1 not in module.lines and 4 not in module.lines  # module level and def lines are not counted
    assert module.lines[5] == "choose" and module.lines[15] == "Cutter.cut" and module.lines[20] == "Cutter.needs_cuda"
    assert set(cut.lines) == {14, 15, 16, 17}
    assert set(missing) == {f"{toy}:nothing_here", "no_such_module_x:f"}


def test_unreached_branches_listed_with_their_reason(toy):
    measurement = Measurement((toy,), {f"{toy}:Cutter.needs_cuda": "needs CUDA", f"{toy}:7->8": "gap: zero",
                                       "*:raise": "an error path", f"{toy}:99": "a stale declaration"}).start()
    try:
        import toy_engine_mod
        toy_engine_mod.choose(1)
        toy_engine_mod.choose(-1)
        toy_engine_mod.Cutter().cut([1, 2, 3], 2)
        toy_engine_mod.check(1)
    finally:
        result = measurement.finish()
    unreached = {b.key: b for b in result.unreached}
    assert set(unreached) == {f"{toy}:7->8", f"{toy}:20->21", f"{toy}:20->22", f"{toy}:26->27"}
    assert unreached[f"{toy}:7->8"].reason == "gap: zero" and result.gaps == [unreached[f"{toy}:7->8"]]
    assert unreached[f"{toy}:7->8"].source == "if x == 0:"
    assert unreached[f"{toy}:20->21"].reason == "needs CUDA"
    assert unreached[f"{toy}:26->27"].reason == "an error path"
    assert not result.without_reason and result.stale == [f"{toy}:99"]
    assert "1 open gaps, 0 without a reason" in result.summary()
    # choose: 2 + 2 exits, cut's for: 2 (its exit to the return is one), needs_cuda: 2, check: 2
    assert len(result.branches) == 10 and result.reached == 6
    bare = Measurement((toy,), {}).start()
    try:
        toy_engine_mod.choose(1)
    finally:
        result = bare.finish()
    assert {b.key for b in result.without_reason} >= {f"{toy}:5->7", f"{toy}:7->8", f"{toy}:15->16"}


def test_worker_processes_are_measured(toy, tmp_path):
    """A process started after the measurement (as spec verify's workers and rank workers are) measures through
    spec.execute.coverage_hook and its data is combined."""
    measurement = Measurement((toy,), {}).start()
    try:
        script = textwrap.dedent("""
            from spec.execute import coverage_hook
            coverage_hook.start()
            import toy_engine_mod
            toy_engine_mod.choose(0)
            coverage_hook.stop()
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
        subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=120)
    finally:
        result = measurement.finish()
    reached = {b.key for b in result.branches if b.reached}
    assert {f"{toy}:5->7", f"{toy}:7->8"} <= reached  # only the child ran choose(0)


def _assert_declared(report: dict, where: str) -> None:
    section = report.get(engine_coverage.SECTION)
    assert section is not None, f"{where}: no {engine_coverage.SECTION} section (spec verify before issue 36?)"
    assert section["measured"], f"{where}: engine coverage not measured: {section['note']}"
    assert not section["surface_not_found"], f"{where}: surface entries not found: {section['surface_not_found']}"
    bare = [f"{b['key']}  {b['source']}" for b in section["unreached"] if b["reason"] is None]
    assert not bare, (f"{where}: {len(bare)} branches of the engine's surface unreached without a reason (reach "
                      "them with a new draw, or declare them in the profile's unreachable):\n" + "\n".join(bare))


def test_impl_leaves_no_branch_unreached_without_reason(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "spec", "verify", "--engine", "impl", "--profile", "dev", "-n", "2",
                          "--no-repro", "--out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert "engine coverage: " in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_declared(json.loads((tmp_path / "verify-impl.json").read_text()), "impl (dev)")


@pytest.mark.parametrize("path", os.environ.get("ENGINE_COVERAGE_REPORTS", "").split() or [None])
def test_report_leaves_no_branch_unreached_without_reason(path):
    if path is None:
        pytest.skip("ENGINE_COVERAGE_REPORTS names no report (the CI step that ran the engine's verify sets it)")
    _assert_declared(json.loads(Path(path).read_text()), path)


def test_mutants_of_the_surface_install_and_undo(toy):
    """spec mutate's mutants: ast edits of the surface's functions, swapped into the live function and undone."""
    from spec.mutate import install, mutants_of

    import toy_engine_mod
    mutants = mutants_of((toy,))
    by_op = {(m.function, m.operator, m.description) for m in mutants}
    assert ("choose", "compare", "Gt -> GtE") in by_op and ("choose", "branch", "condition negated") in by_op
    assert ("Cutter.cut", "slice", "slice upper + 1") in by_op
    flip = next(m for m in mutants if m.function == "choose" and m.description == "Gt -> GtE")
    assert "x >= 0" in flip.mutated and "x >= 0" in flip.diff()
    assert toy_engine_mod.choose(0) == "zero"
    undo = install(flip)
    try:
        assert toy_engine_mod.choose(0) == "positive"  # the mutant runs in place of the function
    finally:
        undo()
    assert toy_engine_mod.choose(0) == "zero"
    cut = next(m for m in mutants if m.function == "Cutter.cut" and m.description == "slice upper + 1")
    undo = install(cut)
    try:
        assert toy_engine_mod.Cutter().cut([1, 2, 3], 2) == [[1, 2, 3], [3]]
    finally:
        undo()
    assert toy_engine_mod.Cutter().cut([1, 2, 3], 2) == [[1, 2], [3]]
