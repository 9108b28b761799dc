"""The micro-batch checks through a framework's own step layer (spec/invariants/microbatch_step.py): an engine without
verl's micro-batch layer that declares its step with its own cut and restore gets INV-MB-001/006/007/008 run through
them instead of skipped, each case fitted to what its step cuts; a cut that loses a key or a restore that reorders is
caught; a function the layer only restates in the suite's code, or a cut it never makes, is a skip with the reason.
The stand-in framework here is impl's step layer under another name (no verl names). Cost: about 2 s (the pinned
mini-batches of four checks, no hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tensordict import TensorDict

from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.invariants.microbatch_step import BRIDGED
from spec.protocol.step import Cut, StepLayer


class OwnStep(ImplEngine):
    """A framework with no verl-named micro-batch layer: its cut and restore are its step layer's only."""

    name = "own-step"
    changes: dict = {}

    def microbatch_layer(self):
        return None

    def step_layer(self) -> StepLayer:
        layer = ImplEngine().step_layer()
        return replace(layer, name="own", functions={**layer.functions, **self.changes})


def _run(engine, invariant: str) -> None:
    info = CATALOGUE[invariant]
    assert info.skip_reason_for(engine) is None
    for case in info.pinned("any", engine):
        info.check(Ctx(engine, case, "cpu", "any"))


@pytest.mark.parametrize("invariant", sorted(BRIDGED))
def test_the_step_layers_own_cut_and_restore_pass_the_bridged_checks(invariant) -> None:
    _run(OwnStep(), invariant)


def test_the_other_micro_batch_checks_stay_skipped_with_the_reason() -> None:
    reason = CATALOGUE["INV-MB-002"].skip_reason_for(OwnStep())
    assert "not a check of a cut and a restore alone" in reason and "INV-STEP-*" in reason


def test_a_cut_that_loses_a_key_fails_the_keys_check() -> None:
    cut = ImplEngine().step_layer().get("cut")

    def lossy(minis, plan):
        out = []
        for micro, indices in cut(minis, plan):
            kept = []
            for mb in micro:
                mb = mb.copy() if isinstance(mb, TensorDict) else mb
                if "teacher_ids" in mb.keys():
                    del mb["teacher_ids"]
                kept.append(mb)
            out.append((kept, indices))
        return out

    class Lossy(OwnStep):
        changes = {"cut": lossy}

    with pytest.raises(AssertionError, match="teacher_ids"):
        _run(Lossy(), "INV-MB-008")


def test_a_restore_that_reorders_fails_the_order_check() -> None:
    restore = ImplEngine().step_layer().get("restore")

    class Reordering(OwnStep):
        changes = {"restore": lambda output_lst, indices, mini: restore(output_lst[::-1], indices, mini)}

    with pytest.raises(AssertionError):
        _run(Reordering(), "INV-MB-007")


def test_a_restated_function_or_a_cut_never_made_is_a_skip() -> None:
    class Restated(OwnStep):
        def step_layer(self):
            return replace(super().step_layer(), restated={"restore": "the order is kept"})

    class CountOnly(OwnStep):
        def step_layer(self):
            return replace(super().step_layer(), cuts=(Cut.COUNT,))

    assert "restates its restore (the order is kept)" in CATALOGUE["INV-MB-007"].skip_reason_for(Restated())
    assert CATALOGUE["INV-MB-008"].skip_reason_for(Restated()) is None
    assert "never by tokens" in CATALOGUE["INV-MB-001"].skip_reason_for(CountOnly())
    assert all(not case.use_dynamic_bsz for case in CATALOGUE["INV-MB-008"].pinned("any", CountOnly()))
