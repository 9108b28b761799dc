"""No false alarms: the conformance verdict (every non-layout invariant) passes each harmless engine.

A harmless engine (spec/planted/harmless.py) differs from impl only in memory, in values no consumer
reads, or in a layout the contract leaves open. Rejecting one is a false alarm: every instance here must pass
(no expected failures). Layout-profile invariants (``InvariantInfo.layout``: verl's private conventions) are
not part of the verdict and are not run here.

Cost: the ``ci`` profile (derandomized) with ``max_examples=20`` per instance. Not run, since they would re-run
code identical to impl's: the helper-only invariants (the dense conversion, the response-slice helpers: every
harmless engine ships impl's helpers unchanged) and the value-head invariants (every harmless engine's value
head is impl's).
"""

from __future__ import annotations

import pytest

from spec.run.registry import HELPERS
from spec.planted.harmless import HARMLESS, harmless_engine
from spec.run.runner import instances, run_invariant

EXAMPLES = 20


def _engine_level(info) -> bool:
    helper_only = info.modes == ("any",) and info.needs and all(n in HELPERS for n in info.needs)
    return info.kind != "dense" and not helper_only and info.head == "lm"


#: the training step's invariants (INV-STEP-*, a whole step per example) run on the harmless engine whose outputs
#: differ where no consumer reads them; the others change the preparation's hand-off only, which the step reads through
#: the same outputs the value invariants check
STEP_HARMLESS = ("unread_outputs_zeroed",)


def _runs_on(name: str, info) -> bool:
    return _engine_level(info) and (info.kind != "step" or name in STEP_HARMLESS)


CASES = [(name, info, mode) for name in HARMLESS for info, mode in instances()
         if not info.layout and _runs_on(name, info)]


@pytest.mark.parametrize("name, info, mode", CASES, ids=[f"{n}-{i.id}-{m}" for n, i, m in CASES])
def test_verdict_passes_harmless_engine(name, info, mode) -> None:
    outcome = run_invariant(info, harmless_engine(name), mode, "cpu", profile="ci", max_examples=EXAMPLES)
    if outcome.status == "skip":
        pytest.skip(outcome.reason)
    assert outcome.status == "pass", (
        f"false alarm: {info.id} rejects the harmless engine {name!r} ({HARMLESS[name].doc})\n"
        f"{outcome.counterexample} -> {outcome.error}")


def test_enough_harmless_engines() -> None:
    kinds = {h.what for h in HARMLESS.values()}
    assert len(HARMLESS) >= 5 and kinds == {"memory", "unread value", "layout"}


def _same_values(d0: dict, d1: dict) -> bool:
    import torch

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return a == b
    return set(d0) == set(d1) and all(same(d0[k], d1[k]) for k in d0)


def test_harmless_engines_really_differ_from_impl() -> None:
    """Each harmless engine changes something a check could see (else it would show nothing)."""
    from spec.cases.structure import EngineCase
    from spec.execute.harness import execute
    from spec.engines.impl.adapter import ImplEngine

    case = EngineCase(prompt_lens=(2, 1), response_lens=(1, 2), vocab=5, pad_to_length=8, pass_cu_seqlens=True,
                      calculate_entropy=True)
    base = execute(ImplEngine(), case)
    for name, entry in HARMLESS.items():
        run = execute(harmless_engine(name), case)
        inputs_same = _same_values(base.inputs[0], run.inputs[0]) and \
            _same_values(base.output_args[0], run.output_args[0])
        if entry.what == "memory":
            assert inputs_same, f"{name} should change memory only"
            assert run.inputs[0]["input_ids"].data_ptr() != run.micro_batch["input_ids"].values().data_ptr()
        else:  # what it hands the model, or what it returns (a value at a position no consumer reads)
            assert not (inputs_same and _same_values(base.outputs, run.outputs)), \
                f"{name} is identical to impl on {case}"
