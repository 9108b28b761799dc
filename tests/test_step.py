"""The training step's suite side (spec/protocol/step.py, spec/truth/step_oracle.py, spec/invariants/step.py) and impl's
step (impl/step.py): the protocol's checks, the oracle's aggregation against hand-computed losses, the bound that is
not vacuous, impl's ``agg_loss`` against hand-computed values in every mode, the value head trained through the padded
path, and every aggregation mode of a layer pinned. The invariants run on impl in tests/test_invariants.py, against
the planted step bugs in tests/test_power.py and against the harmless engine in tests/test_harmless.py.
Cost: about 5 s (one step per check, no hypothesis)."""

from __future__ import annotations

import pytest
import torch

import impl
import impl.step
from spec.cases.step import StepCase, step_inputs
from spec.engines.kit.step import AGG_LOSS_MODES
from spec.engines.impl.adapter import ImplEngine
from spec.execute.step import run_step
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.invariants.step import pinned_steps
from spec.protocol.step import Aggregation, Divisor, PerToken, Scope, StepLayer, Weighting
from spec.truth.step_model import StepModel
from spec.truth.step_oracle import StepInputs, aggregate, step_truth

MODES = {m.name: m for m in AGG_LOSS_MODES}


def _inputs() -> StepInputs:
    """Two samples: sample 0 has response tokens with losses 1, 2, 4 and mask 1, 0, 1; sample 1 one token, loss 8."""
    n = 4
    return StepInputs(features=torch.zeros(n, 2, dtype=torch.float64), labels=torch.zeros(n, dtype=torch.int64),
                      sample=torch.tensor([0, 0, 0, 1]), mask=torch.tensor([1, 0, 1, 1]),
                      advantages=torch.zeros(n, dtype=torch.float64), old_log_probs=torch.zeros(n, dtype=torch.float64),
                      returns=torch.zeros(n, dtype=torch.float64), batch_size=2, response_width=3)


LOSSES = torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
#: by hand: valid tokens 3 (1 + 4 + 8 = 13); per sequence sums 5 and 8, means 2.5 and 8; two samples; width 3
HAND = {"token-mean": 13 / 3, "token-sum": 13.0, "seq-mean-token-sum": 13 / 2, "seq-mean-token-mean": 10.5 / 2,
        "seq-mean-token-sum-norm": 13 / 2 / 3}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_the_oracle_aggregates_as_computed_by_hand(mode) -> None:
    assert float(aggregate(LOSSES, _inputs(), MODES[mode])) == pytest.approx(HAND[mode])


def test_a_documented_local_mode_averages_its_micro_batches() -> None:
    bnpo = Aggregation("bnpo", Weighting.TOKEN, (Divisor.TOKENS,), Scope.MICRO_BATCH, documented="TRL's docs")
    # micro-batch [0]: 5 / 2 tokens; micro-batch [1]: 8 / 1 token; their mean
    assert float(aggregate(LOSSES, _inputs(), bnpo, groups=[[0], [1]])) == pytest.approx((2.5 + 8) / 2)
    with pytest.raises(ValueError, match="documents"):
        Aggregation("x", scope=Scope.MICRO_BATCH)
    with pytest.raises(ValueError, match="micro-batches' samples"):
        aggregate(LOSSES, _inputs(), bnpo)


def test_a_prompt_mode_weighs_each_prompt_group_equally() -> None:
    """Three samples in two prompt groups ({0, 1}, {2}): sample 0's tokens 1, 2, 4 (mask 1, 0, 1), sample 1's 8,
    sample 2's 16 and 32. Group {0, 1}: 13 over 3 tokens; group {2}: 48 over 2; their mean over the 2 prompts."""
    n = 6
    x = StepInputs(features=torch.zeros(n, 2, dtype=torch.float64), labels=torch.zeros(n, dtype=torch.int64),
                   sample=torch.tensor([0, 0, 0, 1, 2, 2]), mask=torch.tensor([1, 0, 1, 1, 1, 1]),
                   advantages=torch.zeros(n, dtype=torch.float64), old_log_probs=torch.zeros(n, dtype=torch.float64),
                   returns=torch.zeros(n, dtype=torch.float64), batch_size=3, response_width=3,
                   prompt=torch.tensor([0, 0, 1]))
    losses = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], dtype=torch.float64)
    prompt_mean = Aggregation("prompt_mean", Weighting.PROMPT_MEAN, (Divisor.PROMPTS,))
    assert prompt_mean.reads_prompts and not MODES["token-mean"].reads_prompts
    assert float(aggregate(losses, x, prompt_mean)) == pytest.approx((13 / 3 + 48 / 2) / 2)
    # without prompt ids every sample is its own prompt: the mean of sequence means
    alone = StepInputs(**{**x.__dict__, "prompt": None})
    assert float(aggregate(losses, alone, prompt_mean)) == pytest.approx((5 / 2 + 8 + 48 / 2) / 3)
    with pytest.raises(ValueError, match="prompt_groups"):
        StepCase((1, 1), (1, 1), prompt_groups=(1, 2))
    case = StepCase((1, 1, 1), (1, 2, 1), prompt_groups=(2, 1))
    assert case.prompt_ids.tolist() == [0, 0, 1] and step_inputs(case).prompt.tolist() == [0, 0, 1]
    assert "prompts=[2, 1]" in repr(case)


def test_a_horizon_mode_takes_its_constant() -> None:
    assert float(aggregate(LOSSES, _inputs(), MODES["seq-mean-token-sum-norm"], horizon=16)) == pytest.approx(13 / 32)


@pytest.mark.parametrize("mode", sorted(HAND))
def test_impl_agg_loss_matches_the_hand_computed_loss(mode) -> None:
    loss_mat = torch.tensor([[1.0, 2.0, 4.0], [8.0, float("nan"), 5.0]])  # a NaN where the mask is 0 stays out
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    got = impl.step.agg_loss(loss_mat, mask, mode)
    assert float(got) == pytest.approx(HAND[mode])


def test_impl_agg_loss_splits_like_the_whole() -> None:
    """Two micro-batches of one rank, each handed the whole mini-batch's facts, sum to the whole's loss in every mode
    (the micro-batches' padded widths differ: 3 and 1)."""
    loss_mat = torch.tensor([[1.0, 2.0, 4.0], [8.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    facts = {"batch_num_tokens": 3, "global_batch_size": 2, "response_width": 3}
    for mode in HAND:
        parts = impl.step.agg_loss(loss_mat[:1], mask[:1], mode, **facts) + \
            impl.step.agg_loss(loss_mat[1:, :1], mask[1:, :1], mode, **facts)
        assert float(parts) == pytest.approx(HAND[mode]), mode
    with pytest.raises(ValueError, match="batch_num_tokens"):
        impl.step.agg_loss(loss_mat, mask, "token-mean", dp_size=2)


def test_global_facts_gather_every_rank() -> None:
    masks = [torch.nested.nested_tensor_from_jagged(torch.tensor([1, 0, 1]), torch.tensor([0, 2, 3])),
             torch.nested.nested_tensor_from_jagged(torch.tensor([1, 1, 1, 1]), torch.tensor([0, 4]))]
    every = torch.stack([impl.step.local_facts(m) for m in masks])
    facts = impl.step.global_facts(impl.step.local_facts(masks[0]), lambda local: every)
    assert facts == {"batch_num_tokens": 6, "global_batch_size": 3, "dp_size": 2, "response_width": 4}


def test_the_bound_is_not_vacuous() -> None:
    """The oracle's bound is far below a 1% error of the loss or of any gradient element on a real case."""
    case = StepCase((2, 1, 3), (3, 4, 1), loss="policy", mode="token-mean", holes=0.3, seed=5)
    model = StepModel(case.vocab, seed=case.seed)
    truth = step_truth(step_inputs(case), model.weight, PerToken.RATIO, MODES["token-mean"])
    assert truth.loss_bound < 0.01 * abs(truth.loss)
    big = truth.grad.abs() > 1e-3
    assert bool(big.any()) and bool((truth.grad_bound[big] < 0.01 * truth.grad.abs()[big]).all())


def test_a_critic_trains_through_the_padded_path() -> None:
    """The value head's padded outputs backpropagate (impl/dense.py took torch's jagged kernels, which have no
    derivative: "derivative for aten::_padded_dense_to_jagged_forward is not implemented", found by INV-STEP-004)."""
    case = StepCase((2, 1), (3, 2), loss="value", mode="token-mean", use_remove_padding=False, seed=2)
    run = run_step(ImplEngine(), case)
    assert run.grad.abs().sum() > 0


def test_every_aggregation_mode_of_a_layer_is_pinned() -> None:
    layer = ImplEngine().step_layer()
    pinned = {(c.loss, c.mode, c.horizon) for c in pinned_steps(layer, ("packed",))}
    for loss in layer.losses:
        for mode in loss.modes:
            horizons = loss.horizons if Divisor.HORIZON in mode.divisors else (None,)
            assert {(loss.name, mode.name, h) for h in horizons} <= pinned


def test_the_step_layer_protocol_refuses_unknown_functions() -> None:
    with pytest.raises(ValueError, match="unknown functions"):
        StepLayer("x", cuts=(), facts=(), losses=(), functions={"prepare": print})
    layer = ImplEngine().step_layer()
    assert layer.lacks() is None and "cut" in StepLayer("y", (), (), (), {}, dp_sizes=(1,)).lacks()
    assert layer.collective and "forward_backward" not in StepLayer("y", (), (), (), {}, dp_sizes=(1,)).lacks()


def test_ranks_in_one_process_are_a_declared_choice() -> None:
    """A layer without the library's own step function that draws DP > 1 says why its ranks may run in one process."""
    with pytest.raises(ValueError, match="in_process"):
        StepLayer("y", (), (), (), {}, dp_sizes=(1, 2))
    assert StepLayer("y", (), (), (), {}, dp_sizes=(1, 2), in_process="no collective").in_process


@pytest.mark.parametrize("invariant", ["INV-STEP-001", "INV-STEP-002", "INV-STEP-003", "INV-STEP-004"])
def test_impl_passes_each_step_check_on_a_two_rank_token_budget_case(invariant) -> None:
    case = StepCase((2, 1, 3, 1), (3, 1, 2, 4), dp=2, cut="tokens", max_token_len=7, loss="policy",
                    mode="seq-mean-token-sum-norm", holes=0.3, seed=3)
    CATALOGUE[invariant].check(Ctx(ImplEngine(), case, "cpu", "any"))


def test_per_token_losses_by_hand() -> None:
    """Uniform logits over 4 ids (every log-prob -log 4): each per-token form against its value worked by hand."""
    import math

    n = 2
    z = torch.zeros(n, 4, dtype=torch.float64)
    lp = -math.log(4)
    x = StepInputs(features=torch.zeros(n, 1, dtype=torch.float64), labels=torch.tensor([1, 3]),
                   sample=torch.tensor([0, 0]), mask=torch.tensor([1, 1]),
                   advantages=torch.tensor([0.5, -2.0], dtype=torch.float64),
                   old_log_probs=torch.full((n,), lp, dtype=torch.float64),
                   returns=torch.tensor([2.0, -1.0], dtype=torch.float64), batch_size=1, response_width=2,
                   teacher_ids=torch.tensor([[0, 1], [2, 3]]),
                   teacher_logprobs=torch.full((n, 2), math.log(0.5), dtype=torch.float64))
    from spec.truth.step_oracle import per_token_loss

    expect = {PerToken.NLL: [math.log(4)] * 2, PerToken.RATIO: [-0.5, 2.0], PerToken.SEQUENCE_RATIO: [-0.5, 2.0],
              PerToken.VALUE: [2.0, 0.5], PerToken.TOPK_FORWARD_KL: [math.log(2)] * 2}
    for kind, want in expect.items():
        assert per_token_loss(kind, z, x).tolist() == pytest.approx(want), kind
    # the parameterised forms on policy (ratio 1): CISPO's weight 1 under its cap, SAPO's gate sigmoid(0) = 1/2,
    # VESPO's phi(1) = 1
    gate = {"tau_pos": 1.0, "tau_neg": 2.0}
    gamma = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    assert per_token_loss(PerToken.CLIPPED_WEIGHT, z, x, {"low": 0.0, "high": 5.0}).tolist() == pytest.approx(
        [0.5 * math.log(4), -2 * math.log(4)])
    assert per_token_loss(PerToken.SOFT_GATE, z, x, gate).tolist() == pytest.approx([-1.0, 2.0])
    assert per_token_loss(PerToken.GAMMA_WEIGHT, z, x, gamma).tolist() == pytest.approx(
        [0.5 * math.log(4), -2 * math.log(4)])
    # GSPO-token's value is the sequence ratio's, its gradient each token's own: on policy, d/dz_t of the losses' sum
    # is -A_t (onehot - 1/4) for GSPO-token, -(mean of A over the sequence) (onehot - 1/4) through the sequence mean
    onehot = torch.nn.functional.one_hot(x.labels, 4).to(torch.float64) - 0.25
    for kind, factor in ((PerToken.SEQUENCE_RATIO_TOKEN, -x.advantages.unsqueeze(1)),
                         (PerToken.SEQUENCE_RATIO, -x.advantages.mean().expand(n, 1))):
        zz = z.clone().requires_grad_(True)
        values = per_token_loss(kind, zz, x)
        assert values.tolist() == pytest.approx([-0.5, 2.0]), kind
        (grad,) = torch.autograd.grad(values.sum(), zz)
        assert torch.allclose(grad, factor * onehot), kind
    # off policy: each token's log-ratio 0.1 (ratio e^0.1), the sequence's 0.2
    off = StepInputs(**{**x.__dict__, "old_log_probs": torch.full((n,), lp - 0.1, dtype=torch.float64)})
    assert per_token_loss(PerToken.CLIPPED_WEIGHT, z, off, {"low": 0.0, "high": 1.05}).tolist() == pytest.approx(
        [1.05 * 0.5 * math.log(4), -1.05 * 2 * math.log(4)])
    r = math.exp(0.1)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    assert per_token_loss(PerToken.SOFT_GATE, z, off, gate).tolist() == pytest.approx(
        [-sig(r - 1) * 4 * 0.5, -sig(2 * (r - 1)) * 4 / 2 * -2.0])
    w = math.exp(0.2)
    phi_pos, phi_neg = math.exp(3 + 2 * 0.2 - 3 * w), math.exp(2 + 3 * 0.2 - 2 * w)
    assert per_token_loss(PerToken.GAMMA_WEIGHT, z, off, gamma).tolist() == pytest.approx(
        [phi_pos * 0.5 * math.log(4), phi_neg * -2 * math.log(4)])
    # GPG's plain policy gradient, -A log_prob, on policy or off; DRO's adds beta/2 (log-ratio 0.1)^2
    for inputs in (x, off):
        assert per_token_loss(PerToken.POLICY_GRADIENT, z, inputs).tolist() == pytest.approx(
            [0.5 * math.log(4), -2 * math.log(4)])
    assert per_token_loss(PerToken.QUADRATIC_PENALTY, z, off, {"beta": 4.0}).tolist() == pytest.approx(
        [0.5 * math.log(4) + 2 * 0.01, -2 * math.log(4) + 2 * 0.01])


def test_loss_declaration_names_its_parameters() -> None:
    """A per-token form's parameters are named in its declaration: one missing or unknown is an error there, not a
    KeyError in the oracle mid-run."""
    from spec.protocol.step import Aggregation, LossDeclaration

    with pytest.raises(ValueError, match="reads the parameters"):
        LossDeclaration("cispo", PerToken.CLIPPED_WEIGHT, (Aggregation("cispo"),))
    with pytest.raises(ValueError, match="reads the parameters"):
        LossDeclaration("grpo", PerToken.RATIO, (Aggregation("grpo"),), parameters={"high": 5.0})
