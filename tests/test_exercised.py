"""No vacuous examples: every invariant exercises its property on >= 90% of the examples it draws
(its strategy and ``adjust`` force the preconditions; a check that truly cannot exercise an example
calls ``ctx.not_exercised``), measured on impl under the ``ci`` profile (a 25-example sample each)."""

from __future__ import annotations

import pytest

from spec.run.registry import load_engine
from spec.run.runner import instances, run_invariant

ENGINE = load_engine("impl")
CASES = [(info, mode) for info, mode in instances() if "cuda" not in info.needs]


@pytest.mark.parametrize("info, mode", CASES, ids=[f"{i.id}-{m}" for i, m in CASES])
def test_invariant_exercises_its_examples(info, mode) -> None:
    outcome = run_invariant(info, ENGINE, mode, "cpu", profile="ci", max_examples=25)
    if outcome.status in ("skip", "xfail"):
        pytest.skip(f"{outcome.status}: {outcome.reason}")
    assert outcome.status == "pass", outcome.error
    assert outcome.examples > 0
    share = outcome.exercised / outcome.examples
    assert share >= 0.9, (f"{info.id}/{mode} exercised its property on {outcome.exercised} of "
                           f"{outcome.examples} examples ({share:.0%}); force the preconditions in adjust")
