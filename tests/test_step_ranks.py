"""The training step on real data-parallel ranks (spec/execute/step_rank.py): a step layer with the framework's own step
function (``forward_backward``) runs DP > 1 on gloo ranks, and what each micro-batch's loss is handed comes from those
ranks' own collectives, never restated by the suite. impl's step (``impl.step.forward_backward_batch``) is the
reference here; verl's runs in tests/test_step_engines.py (its venv). Cost: one pool of 4 ranks started (about 5 s
alone on an idle core, up to 15 s on a loaded machine), then well under a second per step."""

from __future__ import annotations

import pytest

from spec.cases.step import StepCase
from spec.engines.impl.adapter import ImplEngine
from spec.execute import ranks
from spec.execute.step import cut_step, on_real_ranks, run_step
from spec.planted import planted_engine

pytestmark = pytest.mark.skipif(ranks.unavailable("cpu") is not None, reason="no gloo ranks here")

#: two ranks whose loss tokens differ (rank 0: 1 + 4 tokens, rank 1: 3 + 2, no holes), two micro-batches each
CASE = StepCase((2, 1, 1, 2), (1, 4, 3, 2), dp=2, cut="count", micro_batch_size=1, seed=3)


def test_each_micro_batch_is_handed_the_facts_the_ranks_reduced() -> None:
    engine = ImplEngine()
    assert on_real_ranks(engine.step_layer(), CASE) and not on_real_ranks(engine.step_layer(), CASE.with_(dp=1))
    run = cut_step(engine, CASE)
    assert run.rows == [[[0], [1]], [[2], [3]]]
    every = [facts for rank in run.handed_facts for facts in rank]
    assert len(every) == 4
    assert all(f["batch_num_tokens"] == 10 and f["dp_size"] == 2 and f["global_batch_size"] == 4
               and f["response_width"] == 4 for f in every), every


def test_a_fact_taken_inside_the_step_function_is_what_the_loss_sees() -> None:
    """The planted step functions' facts reach the loss as they handed them: the world's size for dp_size (4 ranks in
    the pool, a DP group of 2) and rank 0's own tokens (5, not 10), so the checks read the step's, not the suite's."""
    world = cut_step(planted_engine("dp_size_from_world"), CASE)
    assert {f["dp_size"] for rank in world.handed_facts for f in rank} == {ranks.MAX_WORLD}
    one = run_step(planted_engine("token_count_from_one_rank"), CASE)
    assert {f["batch_num_tokens"] for rank in one.handed_facts for f in rank} == {5}
    assert len(one.rank_grads) == 2 and one.losses and all(len(rank) == 2 for rank in one.losses)
