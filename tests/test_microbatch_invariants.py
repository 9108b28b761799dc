"""The micro-batch layer's suite side: the layer protocol, the mini-batch strategies, the skip of an engine without a
layer, and the checks' own honesty (each rejects a hand-made wrong answer). The invariants themselves run on impl in
tests/test_invariants.py and against the planted bugs in tests/test_power.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spec.run.registry import load_engine
from spec.invariants import CATALOGUE
from spec.invariants.microbatch import check_nested, check_sample_keys, rows_of
from spec.cases.microbatch import MiniBatchCase, materialize_minibatch, minibatch_cases
from spec.protocol.microbatch import MICROBATCH_FUNCTIONS, layer_from
from spec.protocol import EngineUnderTest
from spec.run.runner import run_invariant

MB = sorted(key for key in CATALOGUE if key.startswith("INV-MB-"))


def test_every_clause_has_an_invariant() -> None:
    assert MB == [f"INV-MB-{n:03d}" for n in range(1, 20)]
    assert all(CATALOGUE[key].protects for key in MB)


def test_impl_layer_offers_every_function_by_verls_name() -> None:
    layer = load_engine("impl").microbatch_layer()
    assert layer is not None and layer.lacks(MICROBATCH_FUNCTIONS) is None


def test_layer_lookup_names_what_is_missing() -> None:
    class Source:
        __name__ = "somewhere"

        @staticmethod
        def chunk_tensordict(td, chunks):
            return [td]

    layer = layer_from("x", [Source()])
    assert layer.get("chunk_tensordict") is not None
    reason = layer.lacks(["chunk_tensordict", "prepare_micro_batches"])
    assert reason is not None and "prepare_micro_batches" in reason and "somewhere" in reason
    with pytest.raises(ValueError, match="unknown micro-batch function"):
        layer.get("prepare_microbatches")


class _NoLayer(EngineUnderTest):
    name = "no-layer"

    def make(self, head="lm", **settings):
        return load_engine("impl").make(head, **settings)


def test_an_engine_without_a_layer_skips_with_the_reason() -> None:
    outcome = run_invariant(CATALOGUE["INV-MB-001"], _NoLayer(), "any", "cpu", profile="ci", max_examples=2)
    assert outcome.status == "skip" and "micro-batch layer" in (outcome.reason or "")


@settings(max_examples=200, database=None, derandomize=True)
@given(minibatch_cases(allow_over=True, allow_large=True))
def test_cases_are_well_formed(case: MiniBatchCase) -> None:
    assert case.batch_size % case.force_group_size == 0
    assert len(repr(case)) < 400, "a case prints as one short line"
    if case.use_dynamic_bsz and not case.over_budget:
        assert max(case.group_tokens) <= case.budget


def test_budgets_reach_their_boundaries() -> None:
    seen: set[str] = set()

    @settings(max_examples=300, database=None, derandomize=True)
    @given(minibatch_cases(dynamic=True, allow_over=True))
    def collect(case: MiniBatchCase) -> None:
        if case.sp_size == 1:
            if case.budget == max(case.group_tokens):
                seen.add("longest")
            if case.budget == case.total_nnz:
                seen.add("total")
        if case.over_budget:
            seen.add("over")
        if case.force_group_size > 1:
            seen.add("groups")
        if len(set(case.seq_lens)) == 1 and case.batch_size > 1:
            seen.add("equal")
        if case.batch_size == 1:
            seen.add("single")

    collect()
    assert seen == {"longest", "total", "over", "groups", "equal", "single"}


def test_large_tier_reaches_thousands_of_samples() -> None:
    sizes = []

    @settings(max_examples=300, database=None, derandomize=True)
    @given(minibatch_cases(allow_large=True))
    def collect(case: MiniBatchCase) -> None:
        sizes.append(case.batch_size)

    collect()
    assert max(sizes) >= 1000 and min(sizes) == 1


def _mini(**kw) -> tuple[MiniBatchCase, object]:
    case = MiniBatchCase((3, 2, 1), (2, 2, 2), max_token_len=5, mrope=True, topk=2, routed_experts=True, uid=True,
                         per_sample_temperature=True, **kw)
    return case, materialize_minibatch(case)


def test_check_nested_rejects_wrong_samples_and_wrong_layouts() -> None:
    _, mini = _mini()
    ids = mini.get("input_ids")
    check_nested(ids, ids, [0, 1, 2], "ids")
    parts = ids.unbind()
    swapped = torch.nested.as_nested_tensor([parts[1], parts[0], parts[2]], layout=torch.jagged)
    with pytest.raises(AssertionError, match="sample 0 holds"):
        check_nested(swapped, ids, [0, 1, 2], "ids")
    positions = mini.get("position_ids")  # (B, 4, j)
    items = [t for t in positions.unbind()]
    ragged_on_axes = torch.nested.as_nested_tensor([t.T.contiguous() for t in items], layout=torch.jagged)
    with pytest.raises(AssertionError):
        check_nested(ragged_on_axes, positions, [0, 1, 2], "positions")
    dense = torch.zeros(3, 5)
    with pytest.raises(AssertionError, match="dense"):
        check_nested(dense, ids, [0, 1, 2], "ids")
    float_offsets = torch.nested.nested_tensor_from_jagged(ids.values(), ids.offsets().float())
    with pytest.raises(AssertionError, match="offsets of dtype torch.float32"):  # the same samples, float offsets
        check_nested(float_offsets, ids, [0, 1, 2], "ids")


def test_check_sample_keys_rejects_a_dropped_flag_and_a_misplaced_uid() -> None:
    _, mini = _mini()
    check_sample_keys(mini, mini, [0, 1, 2], "whole")
    fewer = mini.clone()
    del fewer["calculate_entropy"]
    with pytest.raises(AssertionError, match="calculate_entropy"):
        check_sample_keys(fewer, mini, [0, 1, 2], "whole")
    with pytest.raises(AssertionError):
        check_sample_keys(mini, mini, [1, 0, 2], "reordered")


def test_rows_of_the_fixed_path_are_consecutive() -> None:
    case, mini = _mini(use_dynamic_bsz=False)
    parts = load_engine("impl").microbatch_layer().get("chunk_tensordict")(mini, 3)
    assert rows_of(case, parts, None) == [[0], [1], [2]]


@pytest.mark.parametrize("bug", ["groups_split", "budget_check_exclusive"])
def test_quiet_layer_bugs_pass_where_their_condition_is_absent(bug) -> None:
    """A quiet planted bug is quiet: without its condition (no groups; a budget no sample meets exactly) the
    invariant that rejects it elsewhere passes, so the rejection is the condition's, not noise."""
    from spec.planted import planted_engine

    engine = planted_engine(bug)
    case = MiniBatchCase((1, 1, 1, 1), (1, 1, 1, 1), max_token_len=5)  # 8 tokens, samples of 2: no boundary hit
    layer = engine.microbatch_layer()
    micro, indices = layer.get("prepare_micro_batches")(materialize_minibatch(case))
    assert sorted(i for part in indices for i in part) == [0, 1, 2, 3]
    assert all(int(mb["input_ids"].offsets()[-1]) <= 5 for mb in micro)
