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


def _run_toy(measurement: Measurement):
    """The toy's calls under ``measurement`` (started here): choose(1), choose(-1), a cut, check(1)."""
    measurement.start()
    try:
        import toy_engine_mod
        toy_engine_mod.choose(1)
        toy_engine_mod.choose(-1)
        toy_engine_mod.Cutter().cut([1, 2, 3], 2)
        toy_engine_mod.check(1)
    finally:
        result = measurement.finish()
    return result


def test_unreached_branches_listed_with_their_reason(toy):
    result = _run_toy(Measurement((toy,), {f"{toy}:Cutter.needs_cuda": "needs CUDA", f"{toy}:7->8": "gap: zero",
                                           "*:raise": "an error path", f"{toy}:99": "a stale declaration"}))
    import toy_engine_mod
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


def test_branches_off_the_path_are_not_counted_and_bad_keys_reported(toy):
    """``off_path`` names branches too (``module:LINE->DEST``, ``module:LINE``): not counted (nor the lines of the
    blocks they enter), listed with their reasons; a key on a line no counted function holds, or on a line no branch
    leaves so, is reported as not found (the engine's coverage test fails on it); one whose branch ran is stale."""
    off = {f"{toy}:7->8": "zero: only another caller passes it", f"{toy}:20": "a CUDA tensor only",
           f"{toy}:5->6": "declared off, but reached", f"{toy}:14->15": "no branch leaves line 14",
           f"{toy}:99->100": "no such line in the surface"}
    result = _run_toy(Measurement((toy,), {"*:raise": "an error path"}, off))
    import toy_engine_mod
    keys = {b.key for b in result.branches}
    assert not keys & {f"{toy}:7->8", f"{toy}:20->21", f"{toy}:20->22", f"{toy}:5->6"}, keys
    assert len(result.branches) == 6 and {b.key for b in result.unreached} == {f"{toy}:26->27"}
    assert not result.without_reason and result.stale == [f"{toy}:5->6"]
    assert set(result.missing) == {f"{toy}:14->15", f"{toy}:99->100"}, result.missing
    assert "`toy_engine_mod:7->8`: zero: only another caller passes it" in "\n".join(result.markdown())
    bare = Measurement((toy,), {}).start()
    try:
        toy_engine_mod.choose(1)
    finally:
        everything = bare.finish()
    assert everything.statements - result.statements == 3  # lines 6, 8 and 21: the blocks the branches enter
    with pytest.raises(AssertionError, match="99->100"):
        _assert_declared({engine_coverage.SECTION: result.as_dict()}, "toy")


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
    """spec mutate's mutants: ast edits of the surface's functions, swapped into the live function and undone; each
    has a stable id, unique in the surface."""
    from spec.execute.probe import install
    from spec.mutate import mutants_of

    import toy_engine_mod
    mutants = mutants_of((toy,))
    by_op = {(m.function, m.operator, m.description) for m in mutants}
    assert ("choose", "compare", "Gt -> GtE") in by_op and ("choose", "branch", "condition negated") in by_op
    assert ("Cutter.cut", "slice", "slice upper + 1") in by_op
    ids = [m.id for m in mutants]
    assert len(set(ids)) == len(ids) and ids == [m.id for m in mutants_of((toy,))]
    flip = next(m for m in mutants if m.function == "choose" and m.description == "Gt -> GtE")
    assert "x >= 0" in flip.mutated and "x >= 0" in flip.diff()
    assert flip.id == "toy_engine_mod:choose:5 compare: Gt -> GtE"
    assert toy_engine_mod.choose(0) == "zero"
    undo = install(flip.mutation)
    try:
        assert toy_engine_mod.choose(0) == "positive"  # the mutant runs in place of the function
    finally:
        undo()
    assert toy_engine_mod.choose(0) == "zero"
    cut = next(m for m in mutants if m.function == "Cutter.cut" and m.description == "slice upper + 1")
    undo = install(cut.mutation)
    try:
        assert toy_engine_mod.Cutter().cut([1, 2, 3], 2) == [[1, 2, 3], [3]]
    finally:
        undo()
    assert toy_engine_mod.Cutter().cut([1, 2, 3], 2) == [[1, 2], [3]]


def test_mutants_skip_the_functions_off_the_path(toy, tmp_path):
    """A function the profile's ``off_path`` declares off the preparation's path gets no mutant (as the engine-code
    coverage counts none of its lines): a method, and a function nested in one that is mutated."""
    from spec.mutate import mutants_of

    (tmp_path / "toy_nested_mod.py").write_text(textwrap.dedent('''\
        def outer(rows):
            class State:
                def __repr__(self):
                    return f"State({rows[0] + 1})"
            return [row - 1 for row in rows if row > 0]
        '''))
    every = {m.function for m in mutants_of((toy,))}
    assert "Cutter.needs_cuda" in every
    off = {f"{toy}:Cutter.needs_cuda": "a CUDA path"}
    assert {m.function for m in mutants_of((toy,), off)} == every - {"Cutter.needs_cuda"}
    nested = mutants_of(("toy_nested_mod",))
    assert {m.line for m in nested} == {4, 5}
    kept = mutants_of(("toy_nested_mod",), {"toy_nested_mod:outer.<locals>.State.__repr__": "a debugging repr"})
    assert kept and {m.line for m in kept} == {5} and [m.id for m in kept] == [m.id for m in nested if m.line == 5]


def test_mutants_skip_the_blocks_a_branch_off_the_path_enters(toy):
    """A branch the profile's ``off_path`` declares off the path (``module:LINE->DEST``) gets no mutant in the block it
    enters; the rest of its function, and the surface, are mutated as before."""
    from spec.mutate import mutants_of

    every = mutants_of((toy,))
    inside = {m.id for m in every if m.function == "Cutter.cut" and m.line == 16}  # the loop's body: its slice
    assert inside
    kept = mutants_of((toy,), {f"{toy}:15->16": "one chunk only"})
    assert {m.id for m in kept} == {m.id for m in every} - inside


def test_probe_swaps_one_mutant_at_a_time(toy):
    """What a rank applies from its task (spec.execute.probe.apply): the mutant it names, another one in its place
    (the first undone), none: the engine's own code again."""
    from spec.execute import probe
    from spec.mutate import mutants_of

    import toy_engine_mod
    mutants = mutants_of((toy,))
    flip = next(m for m in mutants if m.function == "choose" and m.description == "Gt -> GtE")
    eq = next(m for m in mutants if m.function == "choose" and m.description == "Eq -> NotEq")
    try:
        probe.apply({"mutant": flip.mutation, "context": None})
        assert toy_engine_mod.choose(0) == "positive"
        probe.apply({"mutant": eq.mutation, "context": None})
        assert toy_engine_mod.choose(0) == "negative" and toy_engine_mod.choose(1) == "positive"
    finally:
        probe.apply(None)
    assert [toy_engine_mod.choose(x) for x in (-1, 0, 1)] == ["negative", "zero", "positive"]


def test_mutants_are_classified_by_the_profile(toy):
    """A survivor the profile declares equivalent is equivalent with its reason; an uncovered mutant on a line that a
    declared-unreachable branch (its block, its function, a raise) covers is unreachable; any other stays a survivor
    or uncovered, and counts against the score."""
    import ast as ast_

    from spec.mutate import classify, mutants_of, score
    from spec.protocol.profile import EngineProfile

    mutants = mutants_of((toy,))
    tree = {m.file: ast_.parse(Path(m.file).read_text()) for m in mutants}
    survivor = next(m for m in mutants if m.function == "Cutter.cut" and m.operator == "slice")
    cuda = next(m for m in mutants if m.function == "Cutter.needs_cuda")
    raising = next(m for m in mutants if m.function == "check" and m.operator == "branch")
    other = next(m for m in mutants if m.function == "choose" and m.operator == "compare")
    profile = EngineProfile(unreachable={"toy_engine_mod:Cutter.needs_cuda": "needs CUDA"},
                            equivalent_mutants={survivor.id: "the last chunk is cut at len(rows) anyway"})
    survivor.status, cuda.status, other.status = "survived", "uncovered", "uncovered"
    for m in (survivor, cuda, other):
        classify(m, profile, tree)
    assert (survivor.status, survivor.reason) == ("equivalent", "the last chunk is cut at len(rows) anyway")
    assert (cuda.status, cuda.reason) == ("unreachable", "needs CUDA")
    assert other.status == "uncovered"  # no declaration covers line 5: it counts as not killed
    raise_line = next(m for m in mutants_of((toy,)) if m.function == "check")
    blocked = EngineProfile(unreachable={"toy_engine_mod:26->27": "an error path"})
    raise_line.line, raise_line.status = 27, "uncovered"
    classify(raise_line, blocked, tree)
    assert raise_line.status == "unreachable"
    killed = next(m for m in mutants if m is not other and m is not survivor and m is not cuda)
    killed.status = "killed"
    assert score([survivor, cuda, other, killed]) == (1, 2, 0.5)  # equivalent and unreachable are not scored


def test_reach_figures_are_recorded_from_reports(tmp_path, monkeypatch):
    """spec.measured: a verify report's coverage and a mutate report's score recorded in the engine's record, from
    which the docs' figures are written (declared reasons and open gaps counted apart, every survivor listed)."""
    from spec import measured

    monkeypatch.setattr(measured, "FOLDER", tmp_path / "measured")
    verify = {"engine": "toy", "profile": "ci", "verdict": "pass", "engine_coverage": {
        "surface": ["toy_engine_mod"], "measured": True, "branches": 10, "reached": 7, "statements": 20,
        "executed": 18, "unreached_without_reason": 0, "open_gaps": 1,
        "unreached": [{"key": "toy_engine_mod:5->6", "function": "choose", "source": "if x > 0:",
                       "reason": "gap: a positive x"},
                      {"key": "toy_engine_mod:20->21", "function": "Cutter.needs_cuda", "source": "if x.is_cuda:",
                       "reason": "needs CUDA"},
                      {"key": "toy_engine_mod:26->27", "function": "check", "source": "if x is None:",
                       "reason": "an error path"}]}}
    mutate = {"engine": "toy", "seed": 0, "profile": "dev", "confirm": "ci", "score": 0.5, "killed": 1, "scored": 2,
              "summary": "mutation score 50.0%: 1 of 2", "mutants": [
                  {"id": "a", "status": "killed", "reason": "", "targets": ["T/packed"], "diff": "-x\n+y\n"},
                  {"id": "b", "status": "survived", "reason": "", "targets": ["T/packed"], "diff": "-x\n+z\n"},
                  {"id": "c", "status": "equivalent", "reason": "same value", "targets": ["T/packed"], "diff": ""}]}
    (tmp_path / "verify.json").write_text(json.dumps(verify))
    (tmp_path / "mutate.json").write_text(json.dumps(mutate))
    assert measured.main([str(tmp_path / "verify.json"), str(tmp_path / "mutate.json")]) == 0
    table = measured.reach_table()
    assert "70.0% of 10 branches reached (7; unreached: 2 declared unreachable, 1 open gaps" in table
    assert "mutation score 50.0%: 1 of 2" in table
    unreached = measured.unreached_table("toy")
    assert "**open gap**: a positive x" in unreached and "needs CUDA" in unreached
    survivors = measured.survivors_list("toy")
    assert "`b`, survived" in survivors and "`c`, equivalent: same value" in survivors and "`a`" not in survivors
    assert "partial run" not in table
    # a run stopped early says so: its figure is not the engine's
    assert measured.main(["--of", "40", str(tmp_path / "mutate.json")]) == 0
    assert "**a partial run**: 3 of the 40 mutants of its sample" in measured.reach_table()
    with pytest.raises(ValueError, match="fewer than the 3 mutants"):
        measured.record(tmp_path / "mutate.json", of=2)


def test_the_recorder_has_help_and_names_a_missing_report(capsys, tmp_path) -> None:
    """``python -m spec.measured --help`` prints its usage (it was read as a report path, FileNotFoundError); a report
    that is not there is named in a usage error, not a traceback."""
    from spec import measured

    with pytest.raises(SystemExit) as done:
        measured.main(["--help"])
    assert done.value.code == 0 and "--of" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        measured.main([str(tmp_path / "absent.json")])
    assert done.value.code == 2 and f"no report at {tmp_path / 'absent.json'}" in capsys.readouterr().err


def test_the_sample_is_seeded_and_stable_as_the_surface_changes(toy):
    """spec mutate's sample (bottom-k by a seeded hash of the id): the same seed gives the same mutants; another seed
    others; dropping part of the surface keeps every sampled mutant of the rest."""
    from spec.mutate import mutants_of, sample_of

    everything = mutants_of((toy,))
    first = [m.id for m in sample_of(everything, 6, seed=0)]
    assert first == [m.id for m in sample_of(mutants_of((toy,)), 6, seed=0)]
    assert first != [m.id for m in sample_of(everything, 6, seed=1)]
    rest = [m for m in everything if m.function != "choose"]
    kept = [i for i in first if ":choose:" not in i]
    assert [m.id for m in sample_of(rest, len(kept), seed=0)] == kept


def test_a_surface_scored_whole_says_so(toy, tmp_path):
    """A surface with fewer mutants than the sample asked is scored whole: the figure says every one of its mutants
    was run, not "a sample of N" (which reads as a sample below the size asked); a true sample names the surface's
    size beside it, and the report keeps the population."""
    from spec.mutate import mutants_of, sample_of, summary, write_report

    everything = mutants_of((toy,))
    for m in everything:
        m.status = "killed"
    whole = summary(everything, 0, len(everything))
    assert f"every one of the surface's {len(everything)} mutants (no sample drawn)" in whole and "sample of" not in whole
    part = summary(sample_of(everything, 3, seed=0), 0, len(everything))
    assert f"a sample of 3 of the surface's {len(everything)}, seed 0" in part
    assert "a sample of 3, seed 0" in summary(sample_of(everything, 3, seed=0), 0)
    write_report(everything, "toy", tmp_path, seed=0, profile="dev", confirm="ci", population=len(everything))
    assert json.loads((tmp_path / "mutate-toy.json").read_text())["population"] == len(everything)


@pytest.mark.parametrize("engine", ["verl", "trl", "trl-fused", "skyrl-train", "skyrl", "openrlhf", "verl-megatron",
                                    "verl-automodel", "verl-torchtitan"])
def test_declared_equivalent_mutants_are_mutants_of_the_surface(engine):
    """Every mutant an engine's profile declares equivalent is a mutant of its installed surface (a declaration whose
    line moved or whose mutant no longer exists is stale): verl's, TRL's, SkyRL's (both versions), OpenRLHF's and
    verl's Megatron, Automodel and TorchTitan engines' (verl's on the functions they share), where installed (the
    verl091, trl, openrlhf, skyrl and verl-engines CI steps; trl-fused's in the trl step)."""
    from spec.engines.automodel.adapter import AutomodelEngine
    from spec.engines.megatron.adapter import MegatronEngine
    from spec.engines.openrlhf.records import PROFILE as OPENRLHF_PROFILE
    from spec.engines.skyrl.records import PROFILE as SKYRL_PROFILE, TRAIN_PROFILE as SKYRL_TRAIN_PROFILE
    from spec.engines.torchtitan.adapter import TorchTitanEngine
    from spec.engines.trl.fused import TrlFusedEngine
    from spec.engines.trl.records import PROFILE as TRL_PROFILE
    from spec.engines.verl.adapter import VerlEngine
    from spec.mutate import mutants_of

    profile = {"verl": VerlEngine.profile, "trl": TRL_PROFILE, "trl-fused": TrlFusedEngine.profile,
               "skyrl-train": SKYRL_TRAIN_PROFILE, "skyrl": SKYRL_PROFILE, "openrlhf": OPENRLHF_PROFILE,
               "verl-megatron": MegatronEngine.profile, "verl-automodel": AutomodelEngine.profile,
               "verl-torchtitan": TorchTitanEngine.profile}[engine]
    found, missing = regions(profile.surface)
    if missing or not found:
        pytest.skip(f"{engine}'s surface is not installed here: {sorted(missing)[:2]}")
    stale = set(profile.equivalent_mutants) - {m.id for m in mutants_of(profile.surface, profile.off_path)}
    assert not stale, f"declared equivalent, but no such mutant of {engine}'s surface: {sorted(stale)}"


def test_a_gated_measurement_measures_inside_the_engines_calls_and_their_threads(toy):
    """spec verify's measurement is gated: the processes that run checks measure only inside the engine's calls
    (the suite's own lines run untraced), a thread started inside one too; the lines run outside are not counted."""
    import threading

    from spec.execute import coverage_hook
    from spec.execute.attribution import engine_side

    measurement = Measurement((toy,), {}, gated=True).start()
    try:
        import toy_engine_mod
        toy_engine_mod.choose(-1)  # the suite's own call: not measured
        engine_side(toy_engine_mod.choose, "choose")(1)  # the engine's call: measured
        with coverage_hook.engine_code():  # a thread started inside an engine-code block (the harness's ranks)
            thread = threading.Thread(target=toy_engine_mod.check, args=(1,))
            thread.start()
            thread.join()
        toy_engine_mod.Cutter().cut([1, 2, 3], 2)  # outside again: not measured
    finally:
        result = measurement.finish()
    reached = {b.key for b in result.branches if b.reached}
    assert f"{toy}:5->6" in reached and f"{toy}:26->28" in reached, reached
    assert not reached & {f"{toy}:5->7", f"{toy}:15->16"}, reached
