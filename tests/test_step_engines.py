"""Real engines' training steps (spec/engines/<engine>/step.py: verl, TRL, skyrl-train, skyrl, OpenRLHF), each in its own venv
(skipped where its library is not installed; CI runs it in the verl091, trl, openrlhf and skyrl steps): the library's own loss
code runs, its records are real (the failure shows on a case under the record's condition, and a case outside it
passes), and a mode the library documents as local is held to that documented normalisation (declared global, it
fails). Each test checks one or two hand-picked step cases: a few seconds (verl's held-out mutants of its own
``forward_backward_batch`` on real ranks: a pool of 2 ranks started, about 10 s, then a second per mutant).

verl's step at DP > 1 is its own ``FSDPEngine.forward_backward_batch`` on real gloo ranks: a mutant of that function
(installed by ``spec.execute.probe`` in every rank, as ``spec mutate`` installs one) that drops the token count's
all-reduce, takes the DP size from the sequence-parallel group or cuts without agreeing on the micro-batch count
fails a step check; the in-process step before it restated these facts and simulated the agreement, so none of the
three could fail there."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from dataclasses import replace

import pytest
import torch

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


@pytest.mark.skipif(not _has("trl"), reason="TRL is not installed (the trl step's venv)")
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


@pytest.mark.skipif(not _has("trl"), reason="TRL is not installed (the trl step's venv)")
@pytest.mark.parametrize("packed", [False, True])
def test_trl_fused_steps_through_its_fused_head(packed) -> None:
    """trl-fused's step: GRPO's _compute_loss on the fused head's log-probs (the step model hands hidden states and
    its trainable head weight, the fused-head protocol): the gradient through TRL's chunked backward is the oracle's."""
    from spec.execute.step import run_step
    from spec.run.registry import load_engine

    engine = load_engine("trl-fused")
    case = TWO_MICRO_BATCHES.with_(loss="grpo", mode="dapo", use_remove_padding=packed)
    for invariant in ("INV-STEP-001", "INV-STEP-004"):
        _check(engine, case, invariant)
    assert all(grad.abs().sum() > 0 for grad in run_step(engine, case).rank_grads)


@pytest.mark.skipif(not _has("skyrl_train"), reason="skyrl-train is not installed (the skyrl step's venv)")
def test_skyrl_train_token_mean_is_per_micro_batch() -> None:
    from spec.run.registry import load_engine

    engine = load_engine("skyrl-train")
    with pytest.raises(AssertionError, match="in token_mean: gradient"):
        _check(engine, TWO_MICRO_BATCHES.with_(mode="token_mean"))
    _check(engine, TWO_MICRO_BATCHES.with_(mode="sequence_mean"))
    _check(engine, TWO_MICRO_BATCHES.with_(mode="seq_mean_token_sum_norm", horizon=16))



@pytest.mark.skipif(not _has("verl"), reason="verl is not installed (the verl091 step's venv)")
def test_verl_geo_mean_is_each_micro_batchs_own_mean() -> None:
    """verl 0.9.1's geo_mean (GMPO, F26, issue #7913): one micro-batch per rank passes every step check; two one-sample
    micro-batches give twice the loss and gradient, a failure its record names (under its condition); gpg and dro
    (agg_loss with the global facts) pass on the same cut."""
    from spec.engines.verl.step import GEO_MEAN_RECORDS, a_rank_runs_several_micro_batches
    from spec.run.registry import load_engine

    engine = load_engine("verl")
    if engine.step_layer() is None:
        pytest.skip(f"verl {engine.caps.version} ships no distillation losses: its step is not declared")
    whole = TWO_MICRO_BATCHES.with_(loss="geo_mean", mode="seq-mean-token-mean", micro_batch_size=2)
    assert not a_rank_runs_several_micro_batches(whole)
    for invariant in ("INV-STEP-001", "INV-STEP-002", "INV-STEP-003", "INV-STEP-004"):
        _check(engine, whole, invariant)
    cut = whole.with_(micro_batch_size=1)
    assert a_rank_runs_several_micro_batches(cut)
    for record in GEO_MEAN_RECORDS:
        with pytest.raises(AssertionError) as failure:
            _check(engine, cut, record.invariant)
        assert record.excuses(cut, failure.value, engine), str(failure.value)
    for loss in ("gpg", "dro"):
        _check(engine, TWO_MICRO_BATCHES.with_(loss=loss, mode="token-mean"))


@pytest.mark.skipif(not _has("skyrl"), reason="skyrl is not installed (the skyrl step's venv)")
def test_skyrl_token_mean_is_the_mini_batchs(monkeypatch) -> None:
    """skyrl 0.4.0 pre-scales the advantages over the mini-batch (PR #1296): token_mean no longer depends on the cut,
    on one rank or two; the same step normalised per micro-batch (0.3.1's, token_mean_legacy) fails."""
    from spec.engines.skyrl import prescaled_step
    from spec.run.registry import load_engine

    engine = load_engine("skyrl")
    for case in (TWO_MICRO_BATCHES, replace(TWO_MICRO_BATCHES, dp=2, micro_batch_size=1)):
        for mode, horizon in (("token_mean", None), ("sequence_mean", None), ("seq_mean_token_sum_norm", 16)):
            _check(engine, case.with_(mode=mode, horizon=horizon))
    monkeypatch.setattr(prescaled_step, "prescaled", lambda a, mask, *_: a / mask.sum().clamp(min=1))
    with pytest.raises(AssertionError, match="in token_mean: gradient"):
        _check(engine, TWO_MICRO_BATCHES.with_(mode="token_mean"))


@pytest.mark.skipif(not _has("skyrl"), reason="skyrl is not installed (the skyrl step's venv)")
def test_skyrl_prescaling_is_the_librarys() -> None:
    """The step's per-micro-batch pre-scaling (prescaled_step.prescaled, from the mini-batch's facts) gives, row by
    row, what skyrl 0.4.0's own ``apply_loss_reduction_to_advantages_minibatch`` gives of the whole mini-batch with
    the trainer's ``compute_prompt_boundaries``, in every mode: prompt groups of unequal sizes that straddle ranks and
    micro-batches, loss-mask holes, one rank or two."""
    from spec.cases.materialize import select_rows
    from spec.cases.step import materialize_step
    from spec.engines.kit.step import consecutive_cut
    from spec.engines.skyrl import prescaled_step
    from spec.protocol.step import PROMPT_KEY, LossSetting
    from spec.run.registry import load_engine

    load_engine("skyrl").load()
    ppo = importlib.import_module(prescaled_step.PPO_UTILS)
    preprocess = importlib.import_module(prescaled_step.PREPROCESS)
    cases = [StepCase((2, 1, 3, 1, 2, 2), (1, 4, 2, 3, 1, 2), dp=dp, micro_batch_size=mbs, holes=0.3, seed=seed,
                      mode="prompt_mean", prompt_groups=groups)
             for dp, mbs, groups, seed in ((1, 2, (3, 1, 2), 3), (2, 1, (2, 3, 1), 4), (2, 3, (1, 5), 5),
                                           (1, 3, (6,), 6))]
    for case in cases:
        td = materialize_step(case)
        whole = {key: td.get(key).to_padded_tensor(0.0) for key in ("advantages", "response_mask")}
        boundaries = preprocess.compute_prompt_boundaries([str(int(u)) for u in td.get(PROMPT_KEY)])
        minis = [select_rows(td, case.rank_rows(rank)) for rank in range(case.dp)]
        facts = prescaled_step._facts(minis, case.plan)
        cut = consecutive_cut(minis, case.plan)
        for mode in ("token_mean", "token_mean_legacy", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"):
            want = ppo.apply_loss_reduction_to_advantages_minibatch(
                whole["advantages"], whole["response_mask"], mode, case.micro_batch_size, 16,
                prompt_boundaries=boundaries)
            setting = LossSetting("policy", mode, 16)
            for rank, (micro, _) in enumerate(cut):
                rows = iter(case.rank_rows(rank))
                for mb in micro:
                    got = prescaled_step.prescaled(mb.get("advantages").to_padded_tensor(0.0),
                                                   mb.get("response_mask").to_padded_tensor(0.0), facts[rank],
                                                   setting, mb.get(PROMPT_KEY))
                    for row in got:
                        i = next(rows)
                        r = case.response_lens[i]
                        assert torch.allclose(row[:r], want[i, :r], rtol=1e-6, atol=0), (case, mode, i, row, want[i])

class _Mutant(ast.NodeTransformer):
    """One held-out-style mutation of verl's ``forward_backward_batch`` source (``what``: which)."""

    def __init__(self, what: str):
        self.what, self.applied = what, 0

    def visit_Expr(self, node: ast.Expr):  # the all-reduce of batch_num_tokens dropped: each rank's own count
        call = node.value
        if self.what == "no_all_reduce" and isinstance(call, ast.Call) and ast.unparse(call.func).endswith(
                "distributed.all_reduce"):
            self.applied += 1
            return ast.Pass()
        return self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword):
        if self.what == "dp_size_from_sp_group" and node.arg == "dp_size":  # the SP group's size (1 here)
            self.applied += 1
            return ast.keyword("dp_size", ast.parse("self.ulysses_sequence_parallel_size", mode="eval").body)
        if self.what == "count_not_agreed" and node.arg == "same_micro_num_in_dp":
            self.applied += 1
            return ast.keyword("same_micro_num_in_dp", ast.Constant(False))
        return node


def _mutated_forward_backward(what: str) -> tuple[str, str, str]:
    from verl.workers.engine.fsdp import transformer_impl

    tree = ast.parse(textwrap.dedent(inspect.getsource(transformer_impl.FSDPEngine.forward_backward_batch)))
    mutant = _Mutant(what)
    tree = ast.fix_missing_locations(mutant.visit(tree))
    assert mutant.applied == 1, f"mutant {what} applied {mutant.applied} times"
    return transformer_impl.__name__, "FSDPEngine.forward_backward_batch", ast.unparse(tree)


#: two ranks whose loss tokens differ (rank 0: 1 + 4, rank 1: 3 + 2), two micro-batches each; and a token budget
#: under which rank 0 needs two micro-batches alone and rank 1 one
RANKS = StepCase((2, 1, 1, 2), (1, 4, 3, 2), dp=2, cut="count", micro_batch_size=1, seed=3)
RANKS_BUDGET = StepCase((2, 2, 1, 1), (1, 3, 1, 1), dp=2, cut="tokens", max_token_len=5, seed=0)


@pytest.mark.skipif(not _has("verl.trainer.distillation"), reason="verl 0.9.1 is not installed (the verl091 step)")
@pytest.mark.parametrize("what, case, invariant, message", [
    ("no_all_reduce", RANKS, "INV-STEP-004", "in token-mean: gradient"),
    ("dp_size_from_sp_group", RANKS, "INV-STEP-004", "in token-mean: gradient"),
    ("count_not_agreed", RANKS_BUDGET, "INV-STEP-002", r"ranks run \[2, 1\] micro-batches"),
])
def test_verl_forward_backward_batch_mutants_fail_a_step_check(what, case, invariant, message) -> None:
    from spec.execute import probe
    from spec.run.registry import load_engine

    engine = load_engine("verl")
    _check(engine, case, invariant)  # verl as released passes
    probe.set_mutant(_mutated_forward_backward(what))
    try:
        with pytest.raises(AssertionError, match=message):
            _check(engine, case, invariant)
    finally:
        probe.set_mutant(None)


#: two ranks, two one-sample micro-batches each; sample 3's response mask is all 0 (seed 29): no loss token
EMPTY_SAMPLE = StepCase((2, 1, 2, 1), (2, 3, 1, 3), dp=2, cut="count", micro_batch_size=1, loss="ppo",
                        mode="sequence", holes=0.5, seed=29)


@pytest.mark.skipif(not _has("openrlhf"), reason="OpenRLHF is not installed (the openrlhf step's venv)")
def test_openrlhf_sequence_level_loss_counts_the_samples_with_a_loss_token() -> None:
    """OpenRLHF's PolicyLoss with token_level_loss=False divides by the non-empty samples over the DP group (its own
    all-reduce, on real ranks): passes as declared, and the same mode declared over every sample fails."""
    from spec.execute.step import run_step
    from spec.protocol.step import Divisor
    from spec.run.registry import load_engine

    engine = load_engine("openrlhf")
    for invariant in ("INV-STEP-003", "INV-STEP-004"):
        _check(engine, EMPTY_SAMPLE, invariant)
    _check(engine, EMPTY_SAMPLE.with_(mode="token"))
    critic = EMPTY_SAMPLE.with_(loss="value", mode="token")  # the critic's ValueLoss on OpenRLHF's critic forward
    for invariant in ("INV-STEP-001", "INV-STEP-004"):
        _check(engine, critic, invariant)
    facts = run_step(engine, EMPTY_SAMPLE).handed_facts
    assert {f["global_batch_size"] for rank in facts for f in rank} == {1.5}  # 3 non-empty samples / gas 2
    layer = engine.step_layer()
    ppo = layer.loss("ppo")
    every = replace(ppo, modes=tuple(replace(m, divisors=(Divisor.SEQUENCES,)) if m.name == "sequence" else m
                                     for m in ppo.modes))

    class EverySample(type(engine)):
        def step_layer(self):
            return replace(layer, losses=(every, *layer.losses[1:]))

    with pytest.raises(AssertionError, match="in sequence: gradient"):
        _check(EverySample(), EMPTY_SAMPLE.with_(dp=1))


@pytest.mark.skipif(not _has("openrlhf"), reason="OpenRLHF is not installed (the openrlhf step's venv)")
def test_a_mutant_of_a_stubbed_library_runs_on_fresh_ranks() -> None:
    """spec mutate on real ranks started afresh, whose first task is a training step: the mutant's module
    (openrlhf.models.utils, which imports peft) is imported the adapter's way (its stubs) before the swap, not by
    the swap itself, so the step checks the mutant instead of failing on a ModuleNotFoundError (an ImportError
    there was a kill of every mutant a step check ran first: OpenRLHF's three in log_probs_from_logits)."""
    from spec.execute import probe, ranks
    from spec.mutate import mutants_of
    from spec.run.registry import load_engine

    engine = load_engine("openrlhf")
    added = next(m for m in mutants_of(engine.profile.surface, engine.profile.off_path)
                   if m.id == "openrlhf.models.utils:log_probs_from_logits:188 arith: Sub -> Add")
    engine.make()  # the library imported here (as spec mutate's coverage map has), with its stubs
    ranks.shutdown()  # fresh ranks: their first task is the step's
    probe.set_mutant(added.mutation)
    try:
        with pytest.raises(AssertionError, match="gradient") as failed:  # x + logsumexp(x): no log-prob
            _check(engine, EMPTY_SAMPLE)
        assert "ModuleNotFoundError" not in str(failed.value)
    finally:
        probe.set_mutant(None)
        ranks.shutdown()
