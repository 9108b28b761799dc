"""An honest verdict: each test fails on the suite's earlier behaviour.

1. a known failure excuses only the cases and the failure it names (a second bug is still found);
2. only the engine's own calls can reject; the suite's own exceptions are suite errors;
3. the counterexample is hypothesis's shrunk one, exactly;
4. the report counts examples, exercised examples, distinct cases, known hits; layout apart;
5. (harmless engines pass the verdict: tests/test_harmless.py).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import impl
from spec.execute.attribution import AttributedEngine, expect_engine_error, recording
from spec.cases.structure import EngineCase
from spec.execute.harness import execute
from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.protocol.known import ALWAYS, KnownFailure, When
from spec.planted import helper_bugs as H
from spec.planted import planted_engine
from spec.report import failed, markdown, write_reports
from spec.run.runner import run_invariant
from spec.engines.verl.records import KNOWN_BUGS, MROPE_EQUAL_OR_SINGLE

CI = dict(profile="ci")


def _record(invariant: str) -> KnownFailure:
    return next(r for r in KNOWN_BUGS["*"] if r.invariant == invariant)


class _Engine(ImplEngine):
    """impl with some helpers replaced and some known-failure records."""

    def __init__(self, name: str, helpers: dict | None = None, known: tuple = (), lm: type | None = None):
        self.name = name
        self.helpers = helpers or {}
        self.known_failures = known
        self.engine_classes = {"lm": lm or impl.LMHeadEngine, "value": impl.ValueHeadEngine}

    def helper(self, name):
        return self.helpers.get(name) or super().helper(name)


def _positions_off_by_one(data):
    """verl's known mRoPE bug (as_nested_tensor: the 4 axes become ragged when all lengths are equal or
    B = 1) and a second bug in the same invariant, outside that condition: with unequal lengths the
    mRoPE position values come back shifted by one."""
    out = H.left_right_as_nested_positions(data)
    pos = out["position_ids"]
    if pos.dim() == 3 and getattr(pos, "_ragged_idx", 1) == 2:  # the layout came out right: shift the values
        out["position_ids"] = torch.nested.nested_tensor_from_jagged(pos.values() + 1, pos.offsets(), jagged_dim=2)
    return out


# -- 1. known failures are precise -------------------------------------------------------------------

def test_second_bug_behind_a_known_failure_is_reported_with_its_own_minimal_case() -> None:
    engine = _Engine("known+second", {"left_right_2_no_padding": _positions_off_by_one},
                     known=(_record("INV-DENSE-002"),))
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", **CI)
    assert outcome.status == "fail", (outcome.status, outcome.reason)
    # its own case, outside the record's condition: mRoPE sequences of unequal lengths
    match = re.fullmatch(r"DenseCase\(p=\[([\d, ]+)\] r=\[([\d, ]+)\] P=\d+ R=\d+ mrope[^)]* seed=\d+\)",
                         outcome.counterexample)
    assert match, outcome.counterexample
    lens = [int(p) + int(r) for p, r in zip(match[1].split(", "), match[2].split(", "))]
    assert len(set(lens)) > 1, f"lengths {lens} are unequal: outside the record's condition"
    assert "position_ids [" in outcome.error and "ragged" not in outcome.error, outcome.error
    assert outcome.known and outcome.known[0]["key"] == "INV-DENSE-002"
    assert outcome.known_hits >= 1, "the known bug fired too (and was excused) before the second was reported"


def test_known_failure_alone_is_excused_and_the_run_goes_on() -> None:
    engine = _Engine("known-only", {"left_right_2_no_padding": H.left_right_as_nested_positions},
                     known=(_record("INV-DENSE-002"),))
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", **CI)
    assert outcome.status == "xfail", (outcome.status, outcome.error)
    assert 0 < outcome.known_hits < outcome.examples, "hits are counted and the other examples still checked"
    assert outcome.examples >= 100  # not stopped at the first excused example


def test_failure_outside_the_condition_is_real() -> None:
    single = When("B = 1", lambda c: c.batch_size == 1 and c.mrope)
    record = dataclasses.replace(_record("INV-DENSE-002"), when=single)
    engine = _Engine("narrow-record", {"left_right_2_no_padding": H.left_right_as_nested_positions}, known=(record,))
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", **CI)
    assert outcome.status == "fail" and "ragged" in outcome.error
    assert "mrope" in outcome.counterexample and not outcome.counterexample.startswith("DenseCase(p=[1] ")


def test_failure_of_another_kind_inside_the_condition_is_real() -> None:
    record = dataclasses.replace(_record("INV-DENSE-002"), matches=r"something verl never says")
    engine = _Engine("wrong-pattern", {"left_right_2_no_padding": H.left_right_as_nested_positions}, known=(record,))
    assert run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", **CI).status == "fail"


def test_stale_known_failure_fails_the_verdict() -> None:
    engine = _Engine("stale", known=(_record("INV-DENSE-002"),))  # impl has no such bug
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", profile="dev")
    assert outcome.status == "xpass" and "stale" in outcome.reason
    assert failed([outcome])


def test_known_failure_whose_condition_never_held_is_not_stale() -> None:
    """No example met the record's condition: nothing shows the bug gone, so the run passes (0 hits, 0
    passed under it); once an example under the condition passes, the record is stale (above)."""
    never = dataclasses.replace(_record("INV-DENSE-002"), when=When("never", lambda case: False))
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], _Engine("unreached", known=(never,)), "any", profile="dev")
    assert outcome.status == "pass" and outcome.known[0]["hits"] == 0 and outcome.known[0]["passed_under"] == 0
    stale = run_invariant(CATALOGUE["INV-DENSE-002"], _Engine("stale", known=(_record("INV-DENSE-002"),)), "any",
                          profile="dev")
    assert stale.known[0]["passed_under"] > 0


def test_mrope_condition() -> None:
    from spec.cases.structure import DenseCase

    assert MROPE_EQUAL_OR_SINGLE(DenseCase((1,), (2,), 1, 2, mrope=True))
    assert MROPE_EQUAL_OR_SINGLE(DenseCase((1, 2), (2, 1), 2, 2, mrope=True))
    assert not MROPE_EQUAL_OR_SINGLE(DenseCase((1, 2), (2, 2), 2, 2, mrope=True))
    assert not MROPE_EQUAL_OR_SINGLE(DenseCase((1,), (2,), 1, 2, mrope=False))


# -- 2. errors are attributed --------------------------------------------------------------------------

class _Crashes(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        raise RuntimeError("engine crashed")


def _suite_check(ctx) -> None:
    ctx.run  # the engine works
    raise ZeroDivisionError("a bug in the suite's own check")


def _swallowing_check(ctx) -> None:
    """The old error-invariant pattern: any exception counts as a rejection."""
    try:
        execute(ctx.engine, _bucket_topk_case(), ctx.device)
    except Exception:  # noqa: BLE001
        return
    raise AssertionError("accepted silently")


def test_suite_exception_is_a_suite_error_not_a_failure_or_a_pass() -> None:
    info = dataclasses.replace(CATALOGUE["INV-MASK-001"], check=_suite_check)
    outcome = run_invariant(info, ImplEngine(), "padded", profile="dev")
    assert outcome.status == "error" and outcome.error.startswith("suite error: ZeroDivisionError"), outcome
    assert failed([outcome])


def test_engine_crash_is_a_failure_attributed_to_the_engine() -> None:
    engine = _Engine("crashes", lm=_Crashes)
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], engine, "padded", profile="dev")
    assert outcome.status == "fail" and outcome.error.startswith("engine raised RuntimeError"), outcome


def test_power_test_does_not_count_a_crash_as_a_rejection() -> None:
    from tests.test_power import rejected_by_check

    crash = run_invariant(CATALOGUE["INV-MASK-001"], _Engine("crashes", lm=_Crashes), "padded", profile="dev")
    caught = run_invariant(CATALOGUE["INV-MASK-001"], planted_engine("loss_mask_attention"), "padded", profile="dev")
    assert not rejected_by_check(crash) and rejected_by_check(caught)


def test_swallowed_suite_exception_is_no_pass() -> None:
    """The engine accepts bucket + top-K; the suite's processor then raises and the check swallows it:
    that example is a suite error, never a pass."""
    info = dataclasses.replace(CATALOGUE["INV-MASK-001"], check=_swallowing_check)
    outcome = run_invariant(info, planted_engine("bucket_topk_accepted"), "padded", profile="dev")
    assert outcome.status == "error" and "logits_processor_func" in outcome.error, outcome
    assert run_invariant(info, ImplEngine(), "padded", profile="dev").status == "pass"


def _bucket_topk_case() -> EngineCase:
    # 3 tokens padded to a bucket of 8: the suite's top-K processor refuses the misaligned logits
    return EngineCase(prompt_lens=(1,), response_lens=(2,), vocab=4, pad_to_length=8,
                      distillation_keys=("student_mass",), topk=1)


def test_processor_exception_is_no_rejection() -> None:
    """bucket + top-K accepted silently: the suite's processor raising ValueError is not the engine rejecting."""
    case = _bucket_topk_case()
    accepting = AttributedEngine(planted_engine("bucket_topk_accepted"))
    with recording() as log, pytest.raises(AssertionError, match="accepted by the engine .* no rejection"):
        expect_engine_error(lambda: execute(accepting, case), "bucket with top-K")
    assert not log.unhandled_suite()
    rejecting = AttributedEngine(ImplEngine())
    exc = expect_engine_error(lambda: execute(rejecting, case), "bucket with top-K", (ValueError,))
    assert isinstance(exc, impl.UnsupportedConfigError)
    with pytest.raises(AssertionError, match="expected one of"):
        expect_engine_error(lambda: execute(rejecting, case), "bucket with top-K", (KeyError,))


def test_error_invariant_never_passes_an_engine_that_accepts() -> None:
    """Whatever INV-ERR-002's check catches, an engine that accepts bucket + top-K does not pass it."""
    outcome = run_invariant(CATALOGUE["INV-ERR-002"], planted_engine("bucket_topk_accepted"), "packed", **CI)
    assert outcome.status in ("fail", "error"), outcome
    assert "accepted" in outcome.error or "processor" in outcome.error


# -- 3. the shrunk counterexample, exactly as hypothesis reports it --------------------------------------

def _hypothesis_case(exc: BaseException) -> str | None:
    """The case in hypothesis's own "Failing test case" note, rebuilt and printed as the suite prints it."""
    note = next((n for n in getattr(exc, "__notes__", []) if "case=" in n), None)
    if note is None:
        return None
    from spec.cases.structure import DenseCase

    start = note.index("case=") + len("case=")
    # a strategy mapped through core.honour_engine prints as honour_engine(<case>, engine): read the case itself
    start = min(i for i in (note.find("EngineCase(", start), note.find("DenseCase(", start)) if i >= 0)
    depth, end = 0, start
    for end, char in enumerate(note[start:], start):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == ")" and depth == 0:
            break
    return repr(eval(note[start:end + 1], {"EngineCase": EngineCase, "DenseCase": DenseCase}))  # noqa: S307


@pytest.mark.parametrize("bug, invariant_id, mode", [
    ("loss_mask_attention", "INV-MASK-001", "padded"),
    ("mask_helper_ignores_width", "INV-MASK-004", "any"),
    ("pad_mode_unchecked", "INV-ERR-001", "any"),
])
def test_counterexample_is_the_one_hypothesis_reports(monkeypatch, bug, invariant_id, mode) -> None:
    import spec.run.runner as runner

    seen = []
    original = runner._record_failure
    monkeypatch.setattr(runner, "_record_failure", lambda o, exc: (seen.append(exc), original(o, exc)))
    outcome = run_invariant(CATALOGUE[invariant_id], planted_engine(bug), mode, **CI)
    assert outcome.status == "fail"
    (exc,) = seen
    want = _hypothesis_case(exc if not isinstance(exc, BaseExceptionGroup) else exc.exceptions[0])
    assert want is not None and outcome.counterexample == want


def test_loss_mask_attention_counterexample_is_minimal() -> None:
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], planted_engine("loss_mask_attention"), "padded", **CI)
    assert outcome.counterexample.startswith("EngineCase(p=[1] r=[1] V=2 ")
    assert "padded" in outcome.counterexample and outcome.counterexample.endswith("seed=0)")
    assert "[1, 0], expected [1, 1]" in outcome.error


# -- 4. the report ------------------------------------------------------------------------------------

def test_report_counts_and_layout_section(tmp_path) -> None:
    engine = _Engine("known-only", {"left_right_2_no_padding": H.left_right_as_nested_positions},
                     known=(_record("INV-DENSE-002"),))
    known = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", profile="dev")
    layout = run_invariant(CATALOGUE["INV-MASK-001"], planted_engine("loss_mask_attention"), "padded", profile="dev")
    layout.layout = True  # as if INV-MASK-001 were a layout-profile check
    outcomes = [known, layout]
    assert not failed(outcomes), "a failing layout-profile check does not fail the verdict"
    text = markdown(outcomes, engine="x", profile="dev", device="cpu")
    assert "| examples | exercised | distinct cases | known hits |" in text
    assert f"| {known.examples} | {known.exercised} | {known.distinct_cases} | {known.known_hits} |" in text
    verdict_part, layout_part = text.split("## Layout profile")
    assert "INV-MASK-001" in layout_part and "INV-MASK-001" not in verdict_part
    _, js = write_reports(outcomes, tmp_path / "r", engine="x", profile="dev", device="cpu")
    data = json.loads(js.read_text())
    assert data["verdict"] == "pass"
    row = data["outcomes"][0]
    assert {"examples", "exercised", "distinct_cases", "known_hits", "known", "layout"} <= set(row)
    assert row["known"][0]["hits"] == known.known_hits > 0


def test_legacy_known_failure_dict_still_reads() -> None:
    engine = _Engine("legacy", {"left_right_2_no_padding": H.left_right_as_nested_positions},
                     known={"INV-DENSE-002": "as_nested_tensor"})
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], engine, "any", profile="dev")
    assert outcome.status in ("xfail", "xpass") and outcome.known[0]["when"].startswith("every case (legacy")


def test_record_validation() -> None:
    with pytest.raises(Exception):
        KnownFailure("INV-X-001", "bad regex", matches="(")
    record = KnownFailure("INV-X-001", "r", modes=("padded",), when=ALWAYS)
    assert record.applies_to("INV-X-001", "padded") and not record.applies_to("INV-X-001", "packed")
    assert record.key == "INV-X-001/padded"


def test_an_uncertain_record_without_hits_is_not_stale() -> None:
    """A data-dependent record (``certain=False``) whose condition held on passing examples is not reached,
    not stale: its failure shows on some values only."""
    maybe = dataclasses.replace(_record("INV-DENSE-002"), certain=False)
    outcome = run_invariant(CATALOGUE["INV-DENSE-002"], _Engine("maybe", known=(maybe,)), "any", profile="dev")
    assert outcome.status == "pass" and outcome.known[0]["hits"] == 0 and outcome.known[0]["passed_under"] > 0
