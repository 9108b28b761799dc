"""Proof of power: under the ``ci`` profile every planted bug is rejected by the invariants that
claim it, and the seeds' historical bugs are among them."""

from __future__ import annotations

import pytest

from spec.invariants import CATALOGUE
from spec.planted import PLANTED, planted_engine
from spec.run.runner import run_invariant

CASES = [(bug, inv) for bug in PLANTED.values() for inv in bug.caught_by]


def rejected_by_check(outcome) -> bool:
    """A rejection is a failed check (an assertion the invariant makes) with its counterexample: not the engine
    raising (``engine raised ...``, an ``assert`` inside the engine included) nor a suite error
    (:attr:`spec.run.runner.Outcome.rejected_by_check`)."""
    return outcome.rejected_by_check


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


def test_every_planted_bug_and_claim_is_run_here() -> None:
    """The power test runs every planted bug against every invariant that claims it (the registry's real counts:
    the docs state them from the registry, ``python -m spec docs``, checked by tests/test_docs.py), quiet bugs
    included, and no bug is claimed by an invariant the catalogue lacks."""
    assert {bug.name for bug, _ in CASES} == set(PLANTED)
    assert len(CASES) == sum(len(bug.caught_by) for bug in PLANTED.values())
    assert len({(bug.name, inv) for bug, inv in CASES}) == len(CASES), "a bug claims the same invariant twice"
    quiet = [bug for bug in PLANTED.values() if bug.quiet]
    assert quiet and all(any(b is bug for b, _ in CASES) for bug in quiet)
    assert all(bug.caught_by and set(bug.caught_by) <= set(CATALOGUE) for bug in PLANTED.values())


def test_every_invariant_is_shown_to_reject_a_planted_bug() -> None:
    claimed = {inv for bug in PLANTED.values() for inv in bug.caught_by}
    unclaimed = {key for key, info in CATALOGUE.items() if "cuda" not in info.needs} - claimed
    assert not unclaimed, f"invariants no planted bug shows failing: {sorted(unclaimed)}"
