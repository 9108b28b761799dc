"""The vectorised oracle equals the plain per-sequence loop it replaced, bit for bit, and reads only the case.

``spec.oracle.expected`` computes every sequence's expectations in one pass over the batch's tokens;
``spec.oracle.expected_loop`` is the reference: the model run on each sequence of a materialized micro-batch
alone, every quantity read off the contract one sequence at a time. Equal means the same dtype, shape and
float64 bits (0 ulp) for every value, tolerance, condition and bound, over drawn cases of every tier (long sequences, wide
vocabularies, big batches, mRoPE, per-sample and clamped temperatures, every logits dtype, the value head).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings, strategies as st

from spec.cases import EngineCase
from spec.execute.handoff import model_for
from spec.cases.materialize import draws, materialize
from spec.cases.structure import EXECUTION_CONTEXTS
from spec.truth.oracle import LAYOUT_ONLY, LOG_PROB_MIN_CLAMP, Expected, expected, expected_loop, oracle_key
from spec.cases.strategies import engine_cases

KEYS = ("log_probs", "entropy", "sum_pi_squared", "values")


def identical(a: list[torch.Tensor], b: list[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} sequences vs {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{what}[{i}]: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
        both_nan = x.isnan() & y.isnan() if x.is_floating_point() else torch.zeros_like(x, dtype=torch.bool)
        assert bool(((x == y) | both_nan).all()), f"{what}[{i}]: max |diff| {float((x - y).abs().max()):.3g}"


def assert_same_oracle(case: EngineCase) -> None:
    model = model_for(case, "cpu")
    assert_identical(expected(case, model, draws(case)), expected_loop(case, materialize(case), model), case)


def assert_identical(fast: Expected, loop: Expected, case: EngineCase) -> None:
    """Every value, tolerance, condition, tie slack and bound of two expectations of ``case``, bit for bit."""
    for key in KEYS:
        identical(fast.of(key), loop.of(key), key)
    assert fast.distillation.keys() == loop.distillation.keys() == set(case.distillation_keys)
    for key in case.distillation_keys:
        identical(fast.of(key), loop.of(key), key)
    assert fast.tolerance.keys() == loop.tolerance.keys()
    for key in fast.tolerance:
        identical(fast.tolerance[key], loop.tolerance[key], f"tolerance of {key}")
    assert fast.condition.keys() == loop.condition.keys() == fast.tolerance.keys()
    for key in fast.condition:  # what the declared-precision comparison adds to the tolerance is scaled by it
        identical(fast.condition[key], loop.condition[key], f"condition of {key}")
    assert {d: set(k) for d, k in fast.ties.items() if k} == {d: set(k) for d, k in loop.ties.items() if k}
    for dtype, per_key in fast.ties.items():
        for key in per_key:
            identical(per_key[key], loop.ties[dtype][key], f"{dtype} tie slack of {key}")
    assert fast.bounds.keys() == loop.bounds.keys()
    for mechanism in fast.bounds:
        assert fast.bounds[mechanism].keys() == loop.bounds[mechanism].keys()
        for key in fast.bounds[mechanism]:
            identical(fast.bounds[mechanism][key], loop.bounds[mechanism][key], f"{mechanism} bound of {key}")


@settings(max_examples=150)
@given(case=st.one_of(engine_cases(), engine_cases(head="value")))
def test_vectorised_oracle_equals_the_loop(case: EngineCase) -> None:
    assert_same_oracle(case)


def test_seed_cases_and_a_long_mrope_batch() -> None:
    for case in (EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=(0.5, 2.0),
                            calculate_entropy=True, calculate_sum_pi_squared=True,
                            distillation_keys=("distillation_losses", "student_mass", "overlap_count")),
                 EngineCase(prompt_lens=(1, 300, 7), response_lens=(1, 40, 1), vocab=64, mrope=True,
                            temperature=(1e-9, 0.01, 50.0), logits_dtype="bfloat16", seed=11)):
        assert_same_oracle(case)


def test_oracle_reads_the_case_not_a_mutated_batch() -> None:
    """What an engine does to the micro-batch it was handed cannot move the expectation."""
    case = EngineCase(prompt_lens=(2, 3), response_lens=(2, 2), vocab=16, seed=5)
    model = model_for(case, "cpu")
    before = expected(case, model, draws(case)).log_probs
    batch = materialize(case)
    batch["input_ids"].values().zero_()
    identical(expected(case, model, draws(case)).log_probs, before, "log_probs after the batch was zeroed")
    assert not all(torch.equal(a, b) for a, b in zip(expected_loop(case, batch, model).log_probs, before))


@st.composite
def layouts_of(draw, case: EngineCase) -> dict:
    """Values other than ``case``'s for every field of :data:`LAYOUT_ONLY` but the real-rank topology (None off
    real ranks), and an engine switch other than log_prob_min_clamp."""
    other = lambda values, now: draw(st.sampled_from([v for v in values if v != now]))  # noqa: E731
    width = max(case.response_lens)
    return {"use_remove_padding": not case.use_remove_padding, "pass_cu_seqlens": not case.pass_cu_seqlens,
            "pad_to_length": other((None, 4, 7, 1024), case.pad_to_length), "sp_size": other((1, 2, 3, 4), case.sp_size),
            "entropy_chunk_size": other((None, 1, 2, 7), case.entropy_chunk_size),
            "max_response_len": other((None, width, width + 2), case.max_response_len),
            "pad_token_id": (case.pad_token_id + 1) % case.vocab,  # every vocabulary has at least 2 ids
            "context": other(EXECUTION_CONTEXTS, case.context),
            "engine_config": (*case.engine_config, ("a_switch_the_oracle_never_reads", draw(st.integers(1, 3))))}


@settings(max_examples=60)
@given(data=st.data(), case=st.one_of(engine_cases(), engine_cases(head="value")))
def test_cases_alike_but_for_the_layout_have_one_oracle_key_and_one_expectation(data, case: EngineCase) -> None:
    """The oracle's cache key (:func:`oracle_key`, what one example's checks share it by) leaves out only fields the
    oracle never reads: changing every one of them keeps the key and the expectation, bit for bit."""
    other = dataclasses.replace(case, **data.draw(layouts_of(case)))
    assert all(getattr(other, f) != getattr(case, f) for f in LAYOUT_ONLY if f != "topology")
    assert oracle_key(other) == oracle_key(case)
    assert_identical(expected(other, model_for(other, "cpu"), draws(other)),
                     expected(case, model_for(case, "cpu"), draws(case)), case)


def test_a_field_the_oracle_reads_moves_its_key() -> None:
    """The key is not blind to what the oracle reads: the seed, the temperature, a flag it computes, the
    distillation clamp each give another key (and another expectation)."""
    case = EngineCase(prompt_lens=(2, 3), response_lens=(2, 2), vocab=16, seed=5, distillation_keys=("student_mass",))
    for change in ({"seed": 6}, {"temperature": 0.5}, {"calculate_entropy": True}, {"mask_hole_rate": 0.5},
                   {"engine_config": ((LOG_PROB_MIN_CLAMP, -5.0),)}):
        assert oracle_key(dataclasses.replace(case, **change)) != oracle_key(case), change


def test_a_packed_row_splits_at_the_handed_cu_seqlens() -> None:
    """The stand-in model splits a packed row where it is told to (a varlen kernel's ``cu_seqlens``, or Hugging
    Face's ``cu_seq_lens_q``), else where the positions restart: the right boundaries give the logits the positions
    give; one boundary too few (TorchTitan's mRoPE ``cu_seq_q = [0, nnz]``) changes the later sequences' logits and
    not the first's; boundaries of another row (a shard's of the whole row) are not this row's and are ignored."""
    from spec.truth.toy_model import ToyCausalLM

    model = ToyCausalLM(16, seed=3)
    ids = torch.tensor([[3, 5, 7, 2, 9, 4, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    by_positions = model(ids, positions).logits
    for name in ("cu_seqlens", "cu_seq_lens_q"):
        right = model(ids, positions, **{name: torch.tensor([0, 3, 5, 7], dtype=torch.int32)}).logits
        assert torch.equal(right, by_positions), name
    one = model(ids, positions, cu_seqlens=torch.tensor([0, 7])).logits
    assert torch.equal(one[:, :3], by_positions[:, :3])
    assert not torch.allclose(one[:, 3:], by_positions[:, 3:])
    assert torch.equal(model(ids, positions, cu_seqlens=torch.tensor([0, 3, 5, 7, 12])).logits, by_positions)
