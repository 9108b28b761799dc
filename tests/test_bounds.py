"""A known numerical deviation excuses a failure only within the bound its mechanism implies
(spec/protocol/known.py ``KnownFailure.bound``, spec/truth/oracle.py ``cancellation_bounds``). The planted bugs
``entropy_untempered_at_low_temperature`` and ``sum_pi_squared_tenfold_at_low_temperature`` claim verl's
cancellation records in their region and must still be rejected (tests/test_power.py)."""

from __future__ import annotations

import math

import pytest
import torch

from spec.cases.structure import EngineCase
from spec.engines.kit.records import CANCELLATION
from spec.engines.verl.records import SUM_PI_SQUARED_CANCELLATION
from spec.invariants.core import measure_bounds
from spec.protocol.known import KnownFailure, within_bound
from spec.truth.oracle import EPS, cancellation_bounds

LOW_T = EngineCase(prompt_lens=(1,), response_lens=(1,), vocab=4, temperature=0.05, calculate_sum_pi_squared=True)


def _failure(got: float, want: float, bound: float) -> AssertionError:
    exc = AssertionError(f"'sum_pi_squared' of sequence 0: at (0,) got {got}, expected {want} (|diff| "
                         f"{abs(got - want):.3g} > allowed 1e-05; 1 of 1 values differ)")
    measure_bounds(exc, torch.tensor([got]), torch.tensor([want], dtype=torch.float64),
                   {"float32_cancellation": torch.tensor([bound], dtype=torch.float64)})
    return exc


def test_a_bounded_record_excuses_an_error_within_its_bound_only() -> None:
    within = _failure(0.5004, 0.5, bound=1e-3)
    beyond = _failure(5.0, 0.5, bound=1e-3)  # 10x off: far beyond what a cancellation can make
    assert within.bounds["float32_cancellation"] == pytest.approx(0.4, rel=1e-3)
    assert "|error| / float32_cancellation bound = 0.4" in str(within)
    assert SUM_PI_SQUARED_CANCELLATION.excuses(LOW_T, within)
    assert not SUM_PI_SQUARED_CANCELLATION.excuses(LOW_T, beyond)


def test_nan_and_unmeasured_errors_are_never_within() -> None:
    nan = _failure(float("nan"), 0.5, bound=1.0)
    assert nan.bounds["float32_cancellation"] == math.inf
    assert not within_bound(nan, "float32_cancellation", 1.0)
    unmeasured = AssertionError("'sum_pi_squared' of sequence 0: at (0,) got 5.0, expected 0.5 (|diff| 4.5 > allowed")
    assert not SUM_PI_SQUARED_CANCELLATION.excuses(LOW_T, unmeasured)
    unbounded = KnownFailure("INV-VAL-003", "no bound", when=CANCELLATION, matches="sum_pi_squared")
    assert unbounded.excuses(LOW_T, unmeasured)  # a record without a bound behaves as before


def test_cancellation_bounds_follow_the_mechanism() -> None:
    """The entropy bound is c * eps * g * (|logsumexp z| + 1 + sum p |z|) (g: the reduction's growth, plus 2; the 1:
    the rounding of the logsumexp's sum, whatever its size): it grows with |z| = |logits| / T and stays small at
    T = 1; the sum_pi_squared bound is S * expm1(c * eps * g * (|lse 2z| + 1 + 2 (|lse z| + 1)))."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]], dtype=torch.float64)
    for temperature in (1.0, 0.05, 1e-3):
        z = logits / temperature
        probs = torch.softmax(z, -1)
        spq = (probs * probs).sum(-1)
        b = cancellation_bounds(z, probs, spq)
        g = (max(math.sqrt(4), math.log2(5)) + 2) * 4.0 * EPS  # the reduction, and the roundings around it
        lse = torch.logsumexp(z, -1)
        assert torch.allclose(b["entropy"], g * (lse.abs() + 1 + (probs * z.abs()).sum(-1)))
        assert torch.allclose(b["sum_pi_squared"],
                              spq * torch.expm1(g * (torch.logsumexp(2 * z, -1).abs() + 1 + 2 * (lse.abs() + 1))))
    assert float(cancellation_bounds(logits, torch.softmax(logits, -1))["entropy"]) < 2e-5
    assert float(cancellation_bounds(logits / 1e-3, torch.softmax(logits / 1e-3, -1))["entropy"]) > 1e-3


def test_low_precision_logits_get_their_own_cancellation_bound() -> None:
    """bf16/fp16 logits: the oracle derives the same mechanism with that dtype's eps (an engine computing the
    entropy in the logits' dtype, verl's records) besides float32's; float32 logits get float32's only."""
    from spec.execute.handoff import model_for
    from spec.cases.materialize import draws
    from spec.truth.oracle import expected

    case = LOW_T.with_(calculate_entropy=True, logits_dtype="bfloat16")
    got = expected(case, model_for(case, "cpu"), draws(case)).bounds
    assert set(got) == {"float32_cancellation", "bfloat16_cancellation"}
    ratio = torch.finfo(torch.bfloat16).eps / EPS
    for low, high in zip(got["bfloat16_cancellation"]["entropy"], got["float32_cancellation"]["entropy"]):
        assert torch.allclose(low, high * ratio)
    plain = LOW_T.with_(calculate_entropy=True)
    assert set(expected(plain, model_for(plain, "cpu"), draws(plain)).bounds) == {"float32_cancellation"}
