"""Proof of power: under the ``ci`` profile every planted bug is rejected by the invariants that
claim it, and the seeds' historical bugs are among them."""

from __future__ import annotations

import pytest

from spec.invariants import CATALOGUE
from spec.planted import PLANTED, planted_engine
from spec.run.runner import run_invariant

CASES = [(bug, inv) for bug in PLANTED.values() for inv in bug.caught_by]


def rejected_by_check(outcome) -> bool:
    """A rejection is a failed check (an assertion the invariant makes) with its counterexample: not a crash of
    the engine (``engine raised ...``) nor a suite error."""
    return outcome.status == "fail" and bool(outcome.counterexample) and (outcome.error or "").startswith(
        "AssertionError")


@pytest.mark.parametrize("bug, invariant_id", CASES, ids=[f"{b.name}-{i}" for b, i in CASES])
def test_planted_bug_is_rejected(bug, invariant_id) -> None:
    engine = planted_engine(bug.name)
    info = CATALOGUE[invariant_id]
    # No shrinking, and the first rejecting mode suffices: rejection is the claim here;
    # spec/README.md records the shrunk counterexamples.
    outcomes = []
    for mode in info.modes:
        outcomes.append(run_invariant(info, engine, mode, "cpu", profile="ci", shrink=False))
        if rejected_by_check(outcomes[-1]):
            break
    assert any(rejected_by_check(o) for o in outcomes), (
        f"{invariant_id} did not reject planted bug {bug.name!r} ({bug.doc}) by a failed check in any mode: "
        + ", ".join(f"{o.mode}: {o.status} after {o.examples} examples ({o.error})" for o in outcomes))


def test_seed_bugs_are_planted() -> None:
    assert "INV-MASK-001" in PLANTED["loss_mask_attention"].caught_by
    assert "INV-KEYS-001" in PLANTED["drop_distillation_padded"].caught_by


def test_enough_planted_bugs() -> None:
    assert len(PLANTED) >= 12
    assert sum(1 for bug in PLANTED.values() if bug.quiet) >= 15, "quiet planted bugs (issue 10)"
    assert all(set(bug.caught_by) <= set(CATALOGUE) for bug in PLANTED.values())


def test_every_invariant_is_shown_to_reject_a_planted_bug() -> None:
    claimed = {inv for bug in PLANTED.values() for inv in bug.caught_by}
    unclaimed = {key for key, info in CATALOGUE.items() if "cuda" not in info.needs} - claimed
    assert not unclaimed, f"invariants no planted bug shows failing: {sorted(unclaimed)}"
