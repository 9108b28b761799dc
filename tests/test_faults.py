"""The verdict under faults: each test fails on the suite's earlier behaviour.

1. a malformed output (nested values fewer than their offsets claim) is a failed check naming the key, the rank and
   the shape, not a suite error; the suite never calls ``==`` or ``bool()`` on an engine's own object;
2. a rank that dies ends its example at once (a :class:`~spec.execute.ranks.RankFault`, a failed check), and a
   target stops within its fault budget and shrink deadline, which the run enforces and reports;
3. a record excuses a dtype, or an error within a low-precision mechanism's bound, only where the engine's declared
   precision allows it, for every registered engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

import impl
from spec.cases.structure import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.engines.verl.records import LOW_PRECISION_RECORDS, STUDENT_MASS_LOW_PRECISION, verl_precision
from spec.execute import ranks
from spec.execute.attribution import EngineFault, check_outputs, recording
from spec.execute.harness import execute
from spec.invariants import CATALOGUE
from spec.planted import PLANTED, planted_engine
from spec.protocol.known import FLOAT_DTYPES, KnownFailure, When, as_records, declared, declared_mechanism, matching
from spec.run.registry import ENGINES
from spec.run.runner import fault_budget, run_invariant

CASE = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=1.0)


# -- 1. attribution: what the engine returned is the engine's ---------------------------------------------------

def _short(value: torch.Tensor, drop: int = 2) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(value.values()[:-drop], value.offsets())


def test_a_malformed_nested_output_is_an_engine_fault_naming_key_rank_and_shape() -> None:
    values = torch.nested.nested_tensor_from_jagged(torch.arange(5.0), torch.tensor([0, 2, 5]))
    check_outputs({"values": values}, 1)  # well formed
    with pytest.raises(EngineFault, match=r"rank 1: output 'values': values hold 3 entries, offsets claim 5"):
        check_outputs({"values": _short(values)}, 1)
    assert issubclass(EngineFault, AssertionError)  # a failed check, never a suite error


class _ShortValues(impl.ValueHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
        return {key: _short(value) for key, value in out.items()}


class _Engine(ImplEngine):
    def __init__(self, name: str, lm: type = impl.LMHeadEngine, value: type = impl.ValueHeadEngine):
        self.name = name
        self.engine_classes = {"lm": lm, "value": value}


def test_a_malformed_output_is_a_failed_check_not_a_suite_error() -> None:
    engine = _Engine("short-values", value=_ShortValues)
    with recording() as log:  # found where the suite first touches the outputs, kept for the example
        execute(engine, CASE.with_(head="value"))
    assert len(log.faults) == 1 and re.search(r"rank 0: output 'values': values hold \d+ entries, offsets claim \d+",
                                              str(log.faults[0])), log.faults
    outcome = run_invariant(CATALOGUE["INV-VAL-005"], engine, "packed", profile="dev", shrink=False)
    assert outcome.status == "fail" and outcome.blame == "engine fault" and outcome.rejected_by_check, outcome
    assert "values hold" in outcome.error and "offsets claim" in outcome.error, outcome.error


class _Ambiguous:
    """An engine's own object in output_args: comparing it answers a tensor, whose truth is ambiguous."""

    def __eq__(self, other):
        return torch.tensor([True, False])

    def __bool__(self):
        raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")


class _OwnObjectInOutputArgs(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        model_inputs, output_args = super().prepare_model_inputs(mb)
        return model_inputs, {**output_args, "engine_state": _Ambiguous()}


@pytest.mark.parametrize("invariant_id", ["INV-FLAG-001", "INV-FLAG-002", "INV-MUT-004"])
def test_the_suite_never_compares_an_engine_object_it_does_not_own(invariant_id) -> None:
    engine = _Engine("own-object", lm=_OwnObjectInOutputArgs)
    outcome = run_invariant(CATALOGUE[invariant_id], engine, "packed", profile="dev", shrink=False)
    assert outcome.status == "pass", outcome


# -- 2. bounded time under faults ---------------------------------------------------------------------------------

needs_ranks = pytest.mark.skipif(ranks.unavailable("cpu", 2) is not None, reason="no real ranks here")


@needs_ranks
def test_a_dying_rank_is_a_failed_check_within_the_fault_budget(monkeypatch) -> None:
    """The rank exits (os._exit) on every packed row that does not divide sp: each such example replaces the pool.
    Shrinking stops once the budget's examples ended in a rank fault; the outcome reports it."""
    monkeypatch.setenv("SPEC_FAULT_BUDGET", "2")
    outcome = run_invariant(CATALOGUE["INV-RANK-002"], planted_engine("rank_dies_on_uneven_shard"), "packed",
                            profile="ci", shrink=True)
    assert outcome.rejected_by_check and outcome.blame == "engine fault", outcome
    # the planted rank is sp_rank 1 of its group: global rank 1, or 3 (or both) where the case draws a second SP group
    assert re.search(r"died \(rank [13]: exit code 17(, rank [13]: exit code 17)*\)", outcome.error), outcome.error
    assert outcome.budget["faults_allowed"] == 2 and outcome.budget["faults"] <= 2, outcome.budget
    assert outcome.budget["pool_restarts"] <= 2, outcome.budget
    assert outcome.budget["faults"] < 2 or "fault budget spent" in outcome.budget["stopped"], outcome.budget


FAULT_BUGS = ("critic_values_short_on_ranks", "rank_dies_on_uneven_shard", "entropy_rounded_on_chunked_path")


@pytest.mark.parametrize("name", FAULT_BUGS)
def test_each_planted_fault_is_a_failed_check_within_the_run_bounds(monkeypatch, name) -> None:
    """Under ci with shrinking, each fault bug ends in a failed check (never a suite error) and within the bounds
    the run enforces: at most SPEC_FAULT_BUDGET rank faults and pool restarts, shrinking stopped SPEC_SHRINK_DEADLINE
    seconds after the first failure (the outcome says when it stopped it)."""
    if PLANTED[name].caught_by[0].startswith("INV-RANK") and ranks.unavailable("cpu", 2) is not None:
        pytest.skip("no real ranks here")
    monkeypatch.setenv("SPEC_SHRINK_DEADLINE", "20")
    info = CATALOGUE[PLANTED[name].caught_by[0]]
    outcome = run_invariant(info, planted_engine(name), "packed", profile="ci", shrink=True)
    assert outcome.rejected_by_check and outcome.blame in ("check", "engine fault"), outcome
    budget = outcome.budget
    assert budget["shrink_deadline_s"] == 20 and budget["faults"] <= budget["faults_allowed"], budget
    assert budget["pool_restarts"] <= budget["faults_allowed"], budget
    assert budget["stopped"] is None or "spent" in budget["stopped"], budget


def test_the_shrink_deadline_is_enforced_and_reported(monkeypatch) -> None:
    monkeypatch.setenv("SPEC_SHRINK_DEADLINE", "0")
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], planted_engine("mask_off_by_one"), "padded", profile="dev")
    assert outcome.rejected_by_check, outcome
    assert "shrink deadline spent" in (outcome.budget["stopped"] or ""), outcome.budget
    assert outcome.counterexample  # the failure seen so far, reported as it is
    assert fault_budget() >= 1


# -- 3. records against declarations -------------------------------------------------------------------------------

def _grid() -> list[EngineCase]:
    """Cases over the paths a precision declaration distinguishes: logits dtype, packed/padded, chunked entropy,
    fused kernels, head."""
    cases = []
    for dtype, packed, chunk, fused, head in itertools.product(("float32", "bfloat16", "float16"), (True, False),
                                                                (None, 2), (False, True), ("lm", "value")):
        if head == "value" and (fused or chunk):
            continue
        cases.append(CASE.with_(logits_dtype=dtype, use_remove_padding=packed, entropy_chunk_size=chunk,
                                use_fused_kernels=fused, head=head, calculate_entropy=head == "lm",
                                calculate_sum_pi_squared=head == "lm"))
    return cases


KEYS = ("log_probs", "entropy", "sum_pi_squared", "values", "student_mass", "distillation_losses")


def _dtype_failure(key: str, dtype: str) -> AssertionError:
    exc = AssertionError(f"output {key!r} has dtype torch.{dtype}, expected torch.float32")
    exc.output_dtype = (key, f"torch.{dtype}")  # as INV-DEV-001 raises it
    return exc


def _overreach(records, precision, cases=None) -> list[str]:
    """Every (record, case, key, dtype) where a record would excuse a dtype the declaration rules out, as the runner
    matches records (:func:`spec.protocol.known.matching` given the engine)."""
    engine = type("Declared", (), {"precision": staticmethod(precision)})()
    bad = []
    for case in cases or _grid():
        for key, dtype in itertools.product(KEYS, ("bfloat16", "float16")):
            exc = _dtype_failure(key, dtype)
            record = matching([r for r in records if r.invariant == "INV-DEV-001"], case, exc, engine)
            if record is not None and str(precision(key, case).returns) != dtype:
                bad.append(f"{record.key} excuses {key} in {dtype} on {case!r}, declared "
                           f"{precision(key, case).returns}")
    return bad


def test_verl_records_excuse_only_what_verl_declares() -> None:
    """Statically (verl need not be installed): the FSDP engine's low-precision records and its declared rule."""
    assert not _overreach((*LOW_PRECISION_RECORDS, STUDENT_MASS_LOW_PRECISION), verl_precision)


def test_a_record_wider_than_the_declaration_is_held_to_it() -> None:
    """The INV-DEV-001 record as it was: every low-precision output excused whenever the logits are bf16/fp16; verl declares
    the packed chunked entropy float32, so that entropy in bf16 is no known failure."""
    record = next(r for r in LOW_PRECISION_RECORDS if r.invariant == "INV-DEV-001")
    chunked = CASE.with_(logits_dtype="bfloat16", use_remove_padding=True, entropy_chunk_size=2,
                         calculate_entropy=True)
    exc = _dtype_failure("entropy", "bfloat16")
    assert record.excuses(chunked, exc)  # its condition and pattern alone would excuse it
    engine = type("Verl", (), {"precision": staticmethod(verl_precision)})()
    assert not declared(engine, chunked, exc) and not record.excuses(chunked, exc, engine)
    assert record.excuses(chunked, _dtype_failure("log_probs", "bfloat16"), engine)  # declared bf16 there
    assert "float32" in FLOAT_DTYPES


def _loadable():
    for name, (build, _) in ENGINES.items():
        try:
            yield name, build()
        except Exception:  # noqa: BLE001 - its library is not installed here: checked statically above
            continue


def test_no_registered_engine_has_a_record_that_excuses_what_it_declares_otherwise() -> None:
    checked = []
    for name, engine in [*_loadable(), *((f"planted:{b}", planted_engine(b)) for b in PLANTED
                                        if PLANTED[b].known)]:
        records = as_records(engine.known_failures)
        if not any(r.invariant == "INV-DEV-001" for r in records):
            continue
        assert not _overreach(records, engine.precision), name
        checked.append(name)
    assert "planted:entropy_rounded_on_chunked_path" in checked


def test_the_record_check_would_catch_an_overreaching_record() -> None:
    """The check above is no tautology: a record matched without the engine (the suite's earlier behaviour) excuses
    what the declaration rules out."""
    record = next(r for r in LOW_PRECISION_RECORDS if r.invariant == "INV-DEV-001")
    loose = dataclasses.replace(record)
    engine = type("Verl", (), {"precision": staticmethod(verl_precision)})()
    chunked = CASE.with_(logits_dtype="float16", use_remove_padding=True, entropy_chunk_size=2, calculate_entropy=True)
    exc = _dtype_failure("entropy", "float16")
    assert matching([loose], chunked, exc) is loose and matching([loose], chunked, exc, engine) is None
    assert isinstance(record, KnownFailure)


def _low_mechanism(record: KnownFailure) -> str | None:
    """The bf16/fp16 dtype of a record's precision mechanism (``bound=("float16_cancellation", 2.0)``), or None."""
    dtype = record.bound[0].rsplit("_", 1)[0] if record.bound else None
    return dtype if dtype in ("bfloat16", "float16") else None


def _mechanism_overreach(records, precision) -> list[str]:
    """Every (record, case, key) where a record bounded by a bf16/fp16 mechanism applies (its condition holds) to an
    output key it names while the declaration computes and returns that key in another dtype on that path."""
    bad = []
    for record, case in itertools.product(records, _grid()):
        dtype = _low_mechanism(record)
        if dtype is None or not record.when(case):
            continue
        for key in [k for k in KEYS if k == record.output or re.search(re.escape(k), record.matches)]:
            declared_as = precision(key, case)
            if dtype not in (str(declared_as.returns), str(declared_as.scaled_in)):
                bad.append(f"{record.key} ({record.bound[0]}) applies to {key} on {case!r}, declared {declared_as}")
    return bad


def _bounded_failure(key: str, mechanism: str, ratio: float = 0.5) -> AssertionError:
    exc = AssertionError(f"{key!r} of sequence 0: at (1,) got 1.0 (|diff| 0.1 > allowed 0.01)")
    exc.facts, exc.bounds = {"key": key, "sequence": 0, "position": 1}, {mechanism: ratio}  # as match_oracle sets them
    return exc


def test_mechanism_records_apply_only_where_verl_declares_that_dtype() -> None:
    """Statically: each of verl's bf16/fp16 cancellation records holds only on keys and paths verl_precision declares
    computed or returned in that dtype."""
    records = [r for r in LOW_PRECISION_RECORDS if _low_mechanism(r)]
    assert records and not _mechanism_overreach(records, verl_precision)


def test_no_registered_engine_has_a_mechanism_record_beyond_its_declarations() -> None:
    checked = []
    for name, engine in _loadable():
        records = [r for r in as_records(engine.known_failures) if _low_mechanism(r)]
        assert not _mechanism_overreach(records, engine.precision), name
        checked.append(name)
    assert "impl" in checked


def test_a_mechanism_record_wider_than_the_declaration_excuses_nothing_there() -> None:
    """A float16 cancellation record widened to every fp16 case: verl declares its fused kernels' entropy float32
    (computed from float32 values), so a wrong fused entropy within that bound is no known failure, while the
    declared fp16 path's still is; the lint above flags the widened record."""
    record = next(r for r in LOW_PRECISION_RECORDS if r.invariant == "INV-VAL-002" and _low_mechanism(r) == "float16")
    loose = dataclasses.replace(record, when=When("fp16 logits", lambda c: c.logits_dtype == "float16"))
    engine = type("Verl", (), {"precision": staticmethod(verl_precision)})()
    fused = CASE.with_(logits_dtype="float16", use_fused_kernels=True, calculate_entropy=True)
    plain = CASE.with_(logits_dtype="float16", calculate_entropy=True)
    exc = _bounded_failure("entropy", "float16_cancellation")
    assert loose.excuses(fused, exc)  # condition, pattern and bound alone would excuse it
    assert not declared_mechanism(engine, fused, exc, "float16_cancellation")
    assert not loose.excuses(fused, exc, engine) and loose.excuses(plain, exc, engine)
    assert _mechanism_overreach([loose], verl_precision) and not _mechanism_overreach([record], verl_precision)
    assert declared_mechanism(engine, fused, _bounded_failure("entropy", "float32_cancellation"), "float32_cancellation")


def test_an_engine_object_that_does_not_pickle_crosses_from_a_rank_as_its_type() -> None:
    """On real ranks an engine's own handle in output_args (a lock, a lambda) is no suite error: only its type's name
    crosses the process boundary, and the suite reads nothing of it."""
    from spec.execute.rank_worker import Opaque, _nested_safe

    shipped = _nested_safe({"ids": torch.ones(2), "handle": (lambda: 0), "n": 3, "nested": [None, "x"]})
    assert isinstance(shipped["handle"], Opaque) and shipped["handle"].type_name == "builtins.function"
    assert shipped["n"] == 3 and shipped["nested"] == [None, "x"] and torch.equal(shipped["ids"], torch.ones(2))
