"""bench/compare_verify.py, the behaviour-unchanged check of a refactoring: two spec verify JSON reports compared
target by target (no catalogue run: synthetic reports, milliseconds)."""

from __future__ import annotations

import copy

from bench.compare_verify import differences


def _report(**changes) -> dict:
    outcome = {"test_id": "INV-VAL-001-impl-packed-cpu", "invariant": "INV-VAL-001", "status": "pass", "examples": 100,
               "exercised": 100, "distinct_cases": 97, "known_hits": 0, "counterexample": None, "reason": None,
               "blame": None, "layout": False, "known": [], "seconds": 1.5,
               "error": None}
    outcome.update(changes)
    return {"verdict": "pass", "outcomes": [outcome]}


def test_the_same_outcomes_agree_whatever_the_timings() -> None:
    assert differences(_report(), _report(seconds=9.0)) == []


def test_a_changed_outcome_is_a_difference() -> None:
    found = differences(_report(), _report(status="xfail", known_hits=3))
    assert found == ["INV-VAL-001-impl-packed-cpu: status 'pass' -> 'xfail'",
                     "INV-VAL-001-impl-packed-cpu: known_hits 0 -> 3"]
    before, after = _report(), _report()
    after["outcomes"].append(copy.deepcopy(after["outcomes"][0]) | {"test_id": "INV-VAL-002-impl-packed-cpu"})
    assert differences(before, after) == ["INV-VAL-002-impl-packed-cpu: only in after"]


def test_a_moved_module_path_in_a_reason_is_no_difference() -> None:
    assert differences(_report(reason="see spec/engines/verl.py"), _report(reason="see spec/engines/verl/adapter.py")) == []
    assert differences(_report(reason="a"), _report(reason="b")) != []
