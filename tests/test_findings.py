"""The audit's findings on checks weaker than they look, each pinned by a test that failed before.

* INV-FLAG-003 tries every one of its bad flag values, not one picked by ``seed % 24`` (under ``ci`` four were
  never drawn): an engine that silently accepts any single one of them is rejected.
* INV-SET-001 counts only the engine's own exception as a rejection (``spec/execute/attribution.py``), never the
  suite's (it caught ``except Exception``).
* INV-MASK-004's message states the mask expected at the width asked for, not at the width that came back.
* An ``AssertionError`` raised inside the engine is the engine's (``engine raised AssertionError: ...``), never
  a check's failed assertion: the power test and ``spec.detection`` do not count it as a rejection.
"""

from __future__ import annotations

import re

import pytest

import impl
from spec.execute.attribution import suite_side
from spec.detection import detects
from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.invariants.settings import BAD_FLAGS, FLAG_DEFAULTS
from spec.planted import PlantedBug, PlantedEngine, planted_engine
from spec.run.runner import run_invariant


def _accepting(key: str, bad) -> type:
    """impl, except that it silently reads ``key=bad`` as the flag's default (or drops the flag)."""

    def cleaned(mb):
        value = mb.get(key, None) if key in mb.keys() else None
        value = getattr(value, "data", value)
        if key in mb.keys() and type(value) is type(bad) and value == bad:
            mb = mb.copy()
            if key in FLAG_DEFAULTS:
                mb.set_non_tensor(key, FLAG_DEFAULTS[key])
            else:
                del mb[key]
        return mb

    class Accepting(impl.LMHeadEngine):
        def prepare_model_inputs(self, mb):
            return super().prepare_model_inputs(cleaned(mb))

        def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
            return super().prepare_model_outputs(output, output_args, cleaned(mb), logits_processor_func, **kw)

    Accepting.__doc__ = f"accepts {key}={bad!r} silently"
    return Accepting


@pytest.mark.parametrize("key, bad", BAD_FLAGS, ids=[f"{k}={b!r}" for k, b in BAD_FLAGS])
def test_flag003_rejects_an_engine_accepting_any_one_bad_value(key, bad) -> None:
    engine = PlantedEngine(PlantedBug(f"accepts_{key}", ("INV-FLAG-003",), lm=_accepting(key, bad)))
    outcome = run_invariant(CATALOGUE["INV-FLAG-003"], engine, "packed", profile="ci", shrink=False)
    assert outcome.rejected_by_check and f"flag {key}={bad!r}" in outcome.error, outcome


class _SuiteFailsOnBadSettings(ImplEngine):
    """An engine that accepts every impossible setting; its object then hits a failure of the suite's own code."""

    name = "accepts-settings-then-suite-fails"

    def make(self, head: str = "lm", **settings):
        if any(v is not None and not isinstance(v, bool) and isinstance(v, int) and v < 1
               for k, v in settings.items() if k in ("sp_size", "pad_to_length", "entropy_chunk_size")) \
                or settings.get("sp_rank", 0) not in range(settings.get("sp_size", 1)):
            return _SuiteFailure()
        return super().make(head, **settings)


class _SuiteFailure:
    def prepare_model_inputs(self, micro_batch):
        return suite_side(_broken_suite_code, "the suite's processor")(micro_batch)


def _broken_suite_code(micro_batch):
    raise RuntimeError("the suite's own code failed")


def test_set001_counts_only_the_engines_own_rejection() -> None:
    outcome = run_invariant(CATALOGUE["INV-SET-001"], _SuiteFailsOnBadSettings(), "packed", profile="ci",
                            shrink=False)
    assert outcome.status == "fail" and "accepted by the engine" in (outcome.error or ""), outcome


def test_set001_still_passes_impl_and_rejects_the_planted_bug() -> None:
    info = CATALOGUE["INV-SET-001"]
    assert run_invariant(info, ImplEngine(), "packed", profile="ci").status == "pass"
    assert run_invariant(info, planted_engine("chunk_size_or_none"), "packed", profile="ci",
                         shrink=False).rejected_by_check


def test_mask004_message_states_the_width_asked_for() -> None:
    outcome = run_invariant(CATALOGUE["INV-MASK-004"], planted_engine("mask_helper_ignores_width"), "any",
                            profile="ci")
    assert outcome.rejected_by_check, outcome
    m = re.search(r"gave (\[\[.*?\]\]) .*expected (\[\[.*?\]\])", outcome.error)
    assert m and m.group(1) != m.group(2), f"the message shows no difference: {outcome.error}"


class _AssertsInside(impl.LMHeadEngine):
    """An engine whose own code asserts (an internal ``assert`` that fires on every padded batch)."""

    def prepare_model_inputs(self, mb):
        use_remove_padding = getattr(mb.get("use_remove_padding", True), "data", True)
        assert use_remove_padding, "internal: padded batches are not supported here"
        return super().prepare_model_inputs(mb)


def test_an_engines_assert_is_the_engine_raising_not_a_failed_check() -> None:
    bug = PlantedBug("asserts_inside", ("INV-MASK-001",), lm=_AssertsInside)
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], PlantedEngine(bug), "padded", profile="ci", shrink=False)
    assert outcome.status == "fail" and outcome.error.startswith("engine raised AssertionError"), outcome
    assert not outcome.rejected_by_check
    import spec.detection as detection

    original = detection.planted_engine
    detection.planted_engine = lambda name: PlantedEngine(bug)
    try:
        assert detects(bug, "ci") is None, "spec.detection counted an engine's own assert as a rejection"
    finally:
        detection.planted_engine = original


class _NoSequenceParallelism(ImplEngine):
    """impl without sequence parallelism: it takes a bucket and a chunk size, no sp_size; it records what it is
    handed."""

    name = "impl-without-sp"
    handed: list = []

    def lacks(self, feature):
        return "no sequence parallelism here" if str(getattr(feature, "value", feature)) == "sp" else \
            super().lacks(feature)

    def make(self, head: str = "lm", **settings):
        if "sp_size" in settings or "sp_rank" in settings:
            raise AssertionError(f"handed sp settings {settings} although it lacks sp")
        self.handed.append(dict(settings))
        return super().make(head, **settings)


class _NoSettings(_NoSequenceParallelism):
    name = "impl-without-settings"

    def lacks(self, feature):
        value = str(getattr(feature, "value", feature))
        return f"no {value} here" if value in ("sp", "bucket", "chunking") else super().lacks(feature)


def test_set001_hands_only_the_settings_the_engine_takes_and_skips_one_that_takes_none() -> None:
    """INV-SET-001 needs any of sp, bucket, chunking (needs_any): an engine without sequence parallelism is still
    handed its impossible buckets and chunk sizes (and passes where it rejects them); one without any is skipped
    with the reasons, never passed on zero examples."""
    engine = _NoSequenceParallelism()
    outcome = run_invariant(CATALOGUE["INV-SET-001"], engine, "packed", profile="dev", shrink=False)
    assert outcome.status == "pass" and outcome.exercised > 0, outcome
    tried = {key for settings in engine.handed for key in settings}
    assert {"pad_to_length", "entropy_chunk_size"} <= tried and not {"sp_size", "sp_rank"} & tried, tried
    skipped = run_invariant(CATALOGUE["INV-SET-001"], _NoSettings(), "packed", profile="dev", shrink=False)
    assert skipped.status == "skip" and "no sp here" in skipped.reason and "no chunking here" in skipped.reason
