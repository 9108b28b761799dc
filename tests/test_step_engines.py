"""Real engines' training steps (spec/engines/verl/step.py, trl_step.py, skyrl_step.py), each in its own venv (skipped
where its library is not installed; CI runs it in the verl091, trl-openrlhf and skyrl steps): the library's own loss
code runs, its records are real (the failure shows on a case under the record's condition, and a case outside it
passes), and a mode the library documents as local is held to that documented normalisation (declared global, it
fails). Each test checks one or two hand-picked step cases: a few seconds."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest

from spec.cases.step import StepCase
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.protocol.step import Scope

#: two one-sample micro-batches whose responses (and loss tokens) differ: 1 and 4 tokens
TWO_MICRO_BATCHES = StepCase((2, 1), (1, 4), cut="count", micro_batch_size=1, holes=0.0, seed=1)


def _check(engine, case, invariant: str = "INV-STEP-004") -> None:
    CATALOGUE[invariant].check(Ctx(engine, case, "cpu", "any"))


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _has("verl"), reason="verl is not installed (the verl091 step's venv)")
def test_verl_seq_mean_token_sum_norm_default_scale_is_the_micro_batch_width() -> None:
    from spec.run.registry import load_engine

    engine = load_engine("verl")
    layer = engine.step_layer()
    if layer is None:
        pytest.skip(f"verl {engine.caps.version} ships no distillation losses: its step is not declared")
    assert {m.name for m in layer.loss("policy").modes} == {
        "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"}
    default = TWO_MICRO_BATCHES.with_(loss="policy", mode="seq-mean-token-sum-norm")
    with pytest.raises(AssertionError, match="in seq-mean-token-sum-norm: gradient"):
        _check(engine, default)
    _check(engine, default.with_(horizon=16))  # a constant loss_scale_factor: the cut changes nothing
    for mode in ("token-mean", "seq-mean-token-mean"):
        _check(engine, TWO_MICRO_BATCHES.with_(loss="value", mode=mode))
        _check(engine, TWO_MICRO_BATCHES.with_(loss="distillation", mode=mode, topk=2))


@pytest.mark.skipif(not _has("trl"), reason="TRL is not installed (the trl-openrlhf step's venv)")
def test_trl_bnpo_is_held_to_its_documented_local_normalisation() -> None:
    from spec.run.registry import load_engine

    engine = load_engine("trl")
    case = TWO_MICRO_BATCHES.with_(loss="grpo", mode="bnpo")
    _check(engine, case)  # TRL's bnpo: each micro-batch divided by its own tokens, as documented
    layer = engine.step_layer()
    grpo = layer.loss("grpo")
    as_global = replace(grpo, modes=tuple(replace(m, scope=Scope.GLOBAL, documented="") if m.name == "bnpo" else m
                                          for m in grpo.modes))

    class DeclaredGlobal(type(engine)):
        def step_layer(self):
            return replace(layer, losses=(as_global, *layer.losses[1:]))

    with pytest.raises(AssertionError, match="in bnpo: gradient"):
        _check(DeclaredGlobal(), case)
    _check(engine, case.with_(mode="dapo"))  # dapo: the global accumulated batch's tokens


@pytest.mark.skipif(not _has("skyrl_train"), reason="skyrl-train is not installed (the skyrl step's venv)")
def test_skyrl_train_token_mean_is_per_micro_batch() -> None:
    from spec.run.registry import load_engine

    engine = load_engine("skyrl-train")
    with pytest.raises(AssertionError, match="in token_mean: gradient"):
        _check(engine, TWO_MICRO_BATCHES.with_(mode="token_mean"))
    _check(engine, TWO_MICRO_BATCHES.with_(mode="sequence_mean"))
    _check(engine, TWO_MICRO_BATCHES.with_(mode="seq_mean_token_sum_norm", horizon=16))
