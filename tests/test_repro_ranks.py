"""Standalone reproducers of the real-rank invariants (spec/repro/ranks.py): the file starts its own gloo ranks.
A user's engine with a sequence-parallel bug that shows only on real ranks (tests/shard_roll_engine.py: labels
rolled within each rank's shard) fails INV-RANK-002; its reproducer exits 1 with ``spec`` unimportable (in the
parent; the ranks it starts import only torch, tensordict and the engine's module), and the impl twin of the same
case exits 0. One subprocess runs both. The planted rank engines' files (their engine module written out over impl
imported) reproduce INV-RANK-003/006/008 with the suite unimportable, in the file's process and its ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import impl
from spec.cases.structure import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.repro.engine_source import planted_engine_snippet
from spec.repro.writer import write_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

from tests.test_repro import ROOT, RUN_WITHOUT_SPEC
from tests.test_repro_dense import _run_without_spec


def test_a_real_rank_failure_reproduces_on_ranks_the_file_starts(tmp_path) -> None:
    engine = load_engine("tests.shard_roll_engine:make_engine")
    outcome = run_invariant(CATALOGUE["INV-RANK-002"], engine, "packed", "cpu", profile="ci", shrink=False,
                            max_examples=5, database=None)
    assert outcome.status == "fail", (outcome.status, outcome.error)
    assert outcome.case.sp_size > 1
    (rep,) = write_reproducers([outcome], engine, tmp_path, check=False)
    twin, why = write_reproducer(tmp_path / "twin.py", invariant="INV-RANK-002", mode="packed", engine=ImplEngine(),
                                 case=outcome.case)
    assert why is None and rep.status == "written", (rep.status, rep.detail)
    for path in (rep.path, twin):
        text = path.read_text()
        assert "--rank" in text and "init_process_group" in text
        assert not re.search(r"^\s*(import|from)\s+spec\b", text, re.M), path
    codes, out = _run_without_spec([rep.path, twin])
    assert codes[str(rep.path)] == 1 and "FAIL INV-RANK-002 (shard_labels)" in out and "real ranks" in out, out
    assert codes[str(twin)] == 0 and "PASS: INV-RANK-002" in out, out


#: planted real-rank bugs caught by what each rank hands over, not by its outputs' values: (bug, invariant, the
#: file's check that fails, a case it shows on): a row of 2 tokens divides sp = 2 (no pad is due, the bug adds a
#: row of 2); every rank gets the whole row's temperature, 3 tokens; each rank rolls its own shard of 5 tokens
HANDOFF = (
    ("rank_pad_when_divisible", "INV-RANK-003", "rank_pad", EngineCase((1,), (1,), sp_size=2)),
    ("rank_temperature_not_sliced", "INV-RANK-006", "rank_shapes", EngineCase((2,), (1,), sp_size=2)),
    ("rank_roll_after_slice", "INV-RANK-008", "rank_roll_exact", EngineCase((2,), (3,), vocab=16, seed=3, sp_size=2)),
)

#: on PYTHONPATH (first), in the file's process and in every rank it starts: the suite does not import
NO_SPEC = "import sys\nsys.modules['spec'] = None\n"


def _run(paths: list[Path], pythonpath: str) -> tuple[dict[str, int], str]:
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_SPEC, *map(str, paths)], capture_output=True, text=True,
                          env=env, cwd=str(paths[0].parent), timeout=900)
    codes = {line.split()[2]: int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("EXIT")}
    assert set(codes) == {str(p) for p in paths}, done.stdout + done.stderr
    return codes, done.stdout


def test_planted_rank_engines_are_written_out_over_impl() -> None:
    """A planted engine's snippet writes its module out over impl imported: the engine it builds is that source, run
    under a private module name (the process's own spec is neither used nor replaced), subclassing impl's own."""
    before = {name: sys.modules.get(name) for name in ("spec.planted.rank_bugs",)}
    snippet = planted_engine_snippet(load_engine("planted:rank_pad_when_divisible"))
    assert snippet is not None and snippet.standalone and snippet.requires == "rl-ioprep"
    assert re.search(r"^import impl$", snippet.code, re.M)
    assert not re.search(r"^\s*(import|from)\s+spec\b", snippet.code, re.M)
    space: dict = {}
    exec(compile(snippet.code, "snippet", "exec"), space)  # noqa: S102 - the written engine block
    eng = space["make_engine"]("lm", sp_size=1)
    assert type(eng).__name__ == "PadWhenDivisible" and type(eng).__module__ == "_written_spec_planted_rank_bugs"
    assert isinstance(eng, impl.LMHeadEngine)  # over impl imported, not written out
    assert space["helper"]("no_padding_2_padding") is impl.no_padding_2_padding
    assert {name: sys.modules.get(name) for name in before} == before
    # a planted padding helper is written out too, handed out by helper(), and an own companion; a bug in a
    # micro-batch layer keeps the engine's own snippet
    helper_bug = planted_engine_snippet(load_engine("planted:slice_without_shift"))
    assert helper_bug is not None and "'no_padding_2_padding': _written_spec_planted_helper_bugs.slice_without_shift" \
        in helper_bug.code
    own = planted_engine_snippet(load_engine("planted:chunked_topk_drops_last_chunk"))  # an own companion
    assert own is not None and "def logits_processor(case, sp_size, sp_rank)" in own.code
    assert planted_engine_snippet(load_engine("planted:groups_split")) is None
    assert planted_engine_snippet(ImplEngine()) is None


def test_rank_handoff_failures_reproduce_without_the_suite(tmp_path) -> None:
    """INV-RANK-003/006/008's reproducers check what each rank reports and hands over (its pad size, the shapes of
    its labels and temperature, every position of its labels) against values the file computes: the planted
    engines' files exit 1 at the check with the suite unimportable (the engine written out over impl), and the impl
    twins of the same cases exit 0."""
    site = tmp_path / "no-spec"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_SPEC)
    planted, twins = [], []
    for bug, invariant, _, case in HANDOFF:
        path, why = write_reproducer(tmp_path / f"{bug}.py", invariant=invariant, mode="packed",
                                     engine=load_engine(f"planted:{bug}"), case=case)
        twin, why_twin = write_reproducer(tmp_path / f"{bug}-impl.py", invariant=invariant, mode="packed",
                                          engine=ImplEngine(), case=case)
        assert why is None and why_twin is None, (bug, why, why_twin)
        text = path.read_text()
        assert "--rank" in text and "_written_spec_planted" in text and re.search(r"^import impl$", text, re.M), bug
        assert not re.search(r"^\s*(import|from)\s+spec\b", text, re.M), bug
        planted.append(path)
        twins.append(twin)
    codes, out = _run(planted, os.pathsep.join((str(site), str(ROOT))))
    for (bug, invariant, check, _), path in zip(HANDOFF, planted):
        assert codes[str(path)] == 1 and f"FAIL {invariant} ({check}) on the case, sp=2 real ranks" in out, (bug, out)
    assert "pad_size 2, expected 0" in out and "temperature has shape (3,), expected (2,)" in out, out
    codes, out = _run(twins, str(ROOT))
    for (bug, invariant, check, _), path in zip(HANDOFF, twins):
        assert codes[str(path)] == 0 and f"PASS: {invariant}" in out, (bug, out)


def test_rank_distillation_with_the_stand_in_processor_fails_on_the_values(tmp_path) -> None:
    """INV-RANK-005 with the suite's stand-in top-K processor (impl gives none of its own): each rank of the file
    hands the processor it gets in the suite's rank worker, aligned with the rank's shard of the row (not the whole
    row's teacher tensors, which no shard aligns with). The planted even-share gather (7 tokens over sp = 2) fails
    on a distillation value with the suite unimportable; the impl twin of the same case passes."""
    case = EngineCase((4,), (3,), vocab=16, seed=1, sp_size=2, distillation_keys=("distillation_losses",))
    path, why = write_reproducer(tmp_path / "even_share.py", invariant="INV-RANK-005", mode="packed",
                                 engine=load_engine("planted:rank_gather_even_share"), case=case)
    twin, why_twin = write_reproducer(tmp_path / "even_share-impl.py", invariant="INV-RANK-005", mode="packed",
                                      engine=ImplEngine(), case=case)
    assert why is None and why_twin is None, (why, why_twin)
    assert "class ShardedTopKProcessor" in twin.read_text()
    site = tmp_path / "no-spec"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_SPEC)
    codes, out = _run([path], os.pathsep.join((str(site), str(ROOT))))
    assert codes[str(path)] == 1 and "FAIL INV-RANK-005 (values) on the case, sp=2 real ranks" in out, out
    assert "'distillation_losses' of sequence 0" in out and "do not align" not in out, out
    codes, out = _run([twin], str(ROOT))
    assert codes[str(twin)] == 0 and "PASS: INV-RANK-005" in out, out
