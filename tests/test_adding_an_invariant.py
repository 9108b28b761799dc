"""Adding an invariant touches its module, nothing else: one registered the way every module of
spec/invariants registers its own (``@invariant`` with the ``repro`` record of its standalone reproducer) is run on an
engine, fails on a planted bug, and gets a reproducer that reproduces, with no table, writer or runtime edited.

The invariant is registered for the test and removed after it, so no other test sees it.
"""

from __future__ import annotations

import pytest

from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx, invariant, match_oracle
from spec.invariants.reproduction import Plan
from spec.repro import run_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

NEW = "INV-ADD-001"


@pytest.fixture
def new_invariant():
    """A new invariant, written as a module writes one (its property restates INV-VAL-001's: the test is about what
    registering it takes, not about the property)."""
    assert NEW not in CATALOGUE

    @invariant(NEW, "log_probs equal the oracle's", contract=2, protects="a loss reads the model's log-probs",
               adjust=lambda case: case.with_(distillation_only=False),
               repro=Plan(("keys", "values"), keys=("log_probs",)))
    def log_probs_again(ctx: Ctx) -> None:
        match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"])

    try:
        yield CATALOGUE[NEW]
    finally:
        del CATALOGUE[NEW]


def test_a_new_invariant_runs_fails_on_a_bug_and_reproduces(new_invariant, tmp_path) -> None:
    passed = run_invariant(new_invariant, load_engine("impl"), "packed", "cpu", profile="dev", shrink=False,
                           max_examples=5, database=None)
    assert passed.status == "pass" and passed.examples >= 5, (passed.status, passed.examples, passed.error)
    planted = load_engine("planted:double_temperature")
    failed = run_invariant(new_invariant, planted, "packed", "cpu", profile="ci", shrink=False, max_examples=5,
                           database=None)
    assert failed.status == "fail", (failed.status, failed.error)
    (rep,) = write_reproducers([failed], planted, tmp_path)
    assert rep.status == "reproduces", (rep.status, rep.detail)
    code, printed = run_reproducer(rep.path)
    assert code == 1 and f"FAIL {NEW}" in printed, printed
