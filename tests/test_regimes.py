"""The regimes a trainer runs the preparation in are drawn, honoured and reach every engine: the autograd
context (grad, no_grad, inference_mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import impl
from spec.cases import CONTEXTS, EngineCase
from spec.cases.strategies import engine_cases, within_limits
from spec.engines.impl import ImplEngine
from spec.execute.harness import execute
from spec.execute.ranks import unavailable


class _Seen(impl.LMHeadEngine):
    """impl, recording the autograd state of each call and whether the logits it was handed require grad."""

    log: list = []

    def prepare_model_inputs(self, micro_batch):
        self.log.append(("inputs", torch.is_grad_enabled(), torch.is_inference_mode_enabled(), None))
        return super().prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        self.log.append(("outputs", torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                         output.logits.requires_grad))
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class _SeenEngine(ImplEngine):
    name = "seen"
    engine_classes = {"lm": _Seen, "value": impl.ValueHeadEngine}


WANT = {"grad": (True, False, True), "no_grad": (False, False, False), "inference_mode": (False, True, False)}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("sp", [1, 2])
def test_harness_runs_the_engine_in_the_case_context(context, sp) -> None:
    _Seen.log = []
    case = EngineCase((3, 2), (2, 1), vocab=8, temperature=0.5, sp_size=sp, context=context)
    run = execute(_SeenEngine(), case)
    grad, inference, logits_grad = WANT[context]
    assert {(g, i) for _, g, i, _ in _Seen.log} == {(grad, inference)}, _Seen.log
    assert {r for what, _, _, r in _Seen.log if what == "outputs"} == {logits_grad}
    assert run.outputs["log_probs"].requires_grad is logits_grad
    # outside the context again: what the invariants compare with is readable
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


@pytest.mark.skipif(unavailable("cpu", 2) is not None, reason="no real ranks here")
def test_real_ranks_run_the_engine_in_the_case_context() -> None:
    from spec.planted import planted_engine

    engine = planted_engine("inplace_div_without_grad")  # divides the logits in place only without grad
    for context, changed in (("grad", False), ("no_grad", True), ("inference_mode", True)):
        run = execute(engine, EngineCase((3, 2), (2, 1), vocab=8, temperature=0.5, sp_size=2, context=context))
        same = all(torch.equal(out.logits.nan_to_num(), snap["logits"].nan_to_num())
                   for out, snap in zip(run.model_outputs, run.model_output_snapshots))
        assert same is not changed, context


def test_repr_names_the_context_only_when_not_grad() -> None:
    case = EngineCase((1,), (1,))
    assert "grad" not in repr(case)
    assert repr(case.with_(context="no_grad")).endswith("no_grad seed=0)")
    assert "inference_mode" in repr(case.with_(context="inference_mode"))
    with pytest.raises(ValueError, match="context"):
        case.with_(context="eval")


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_context_is_drawn(data) -> None:
    # every context reachable (a single draw can be any of them) and within_limits agrees with the strategy
    case = data.draw(engine_cases(allow_large=False))
    assert case.context in CONTEXTS
    assert within_limits(case) and not within_limits(case, contexts=tuple(c for c in CONTEXTS if c != case.context))


def test_contexts_shrink_to_grad() -> None:
    from hypothesis import find

    assert find(engine_cases(allow_large=False), lambda c: True).context == "grad"
    for context in CONTEXTS:
        assert find(engine_cases(allow_large=False), lambda c, want=context: c.context == want).context == context
