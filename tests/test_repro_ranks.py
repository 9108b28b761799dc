"""Standalone reproducers of the real-rank invariants (spec/repro/ranks.py): the file starts its own gloo ranks.
A user's engine with a sequence-parallel bug that shows only on real ranks (tests/shard_roll_engine.py: labels
rolled within each rank's shard) fails INV-RANK-002; its reproducer exits 1 with ``spec`` unimportable (in the
parent; the ranks it starts import only torch, tensordict and the engine's module), and the impl twin of the same
case exits 0. One subprocess runs both."""

from __future__ import annotations

import re

from spec.engines.impl import ImplEngine
from spec.invariants import CATALOGUE
from spec.repro.writer import write_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

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
    assert codes[str(rep.path)] == 1 and "FAIL INV-RANK-002 (labels)" in out and "real ranks" in out, out
    assert codes[str(twin)] == 0 and "PASS: INV-RANK-002" in out, out
