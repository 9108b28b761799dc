"""verl's training step (the FSDP engines' ``forward_backward_batch`` and its loss functions) as a step layer.

Everything the step computes is verl's own code, imported by name: the cut is ``verl.workers.engine.utils.
prepare_micro_batches`` (a token budget, balanced, or ``micro_batch_size_per_gpu``; the ranks agree on one count as its
``same_micro_num_in_dp`` does); the losses are ``verl.workers.utils.losses``' ``ppo_loss`` (the actor: vanilla PPO
clip, every ``loss_agg_mode`` of ``agg_loss``, ``loss_scale_factor`` None or 16), ``value_loss`` (the critic, every
mode), ``verl.trainer.distillation.losses.distillation_loss`` (the supervised top-K forward KL its own processor
computes in ``prepare_model_outputs``, every mode) and ``sft_loss`` (a token mean), each with verl's own ``FSDPActorConfig``/``FSDPCriticConfig``; the restore is
``postprocess_batch_func``. The global facts are what ``FSDPEngine.forward_backward_batch`` assigns to the mini-batch
before the cut (``batch_num_tokens``: ``data["loss_mask"].sum()`` all-reduced over the DP group; ``dp_size``) and what the
trainer hands it (``global_batch_size``: ``ppo_mini_batch_size``, the samples on every rank), stated here for a
DP = 1 step in one process.

On real ranks (DP > 1) the step is verl's own ``FSDPEngine.forward_backward_batch`` (:func:`verl_forward_backward`),
in a gloo world of exactly ``dp`` ranks (verl's engine without a device mesh reads its DP group and size off the
world: ``torch.distributed.group.WORLD``, ``get_world_size() // sp``): its all-reduced ``batch_num_tokens``, its
``dp_size``, its cut with ``same_micro_num_in_dp`` over the group, its ``forward_step`` and backward, its
``postprocess_batch_func``. What the adapter sets is device plumbing only, each a value verl's constructor would set
on a CPU float32 engine without sequence parallelism: ``ulysses_device_mesh = None`` (sp = 1), ``_autocast_dtype =
float32`` (fp32 parameters: verl skips autocast), ``module`` the stand-in model (with the ``config`` its preparation
reads), and, during the call, ``transformer_impl.get_device_id`` and ``seqlen_balancing.get_device_name`` returning
``"cpu"``, the device of the suite's gloo group (verl's own answer ``"cuda"`` without an accelerator, and the first
raises "Torch not compiled with CUDA enabled" on a CPU-only torch: they only name where ``.to()`` moves the micro-batch
and where the token count and micro-batch count tensors of the all-reduces live). The trainer's facts stay the trainer's: ``global_batch_size`` (``ppo_mini_batch_size * rollout.n``) and the
cut's settings are assigned to the mini-batch as verl's trainer and worker assign them, and ``return_model_output``
is set so the restored outputs come back (Tinker's switch).

verl 0.9.1's ``seq-mean-token-sum-norm`` without ``loss_scale_factor`` divides by the micro-batch's padded width
(``loss_mask.shape[-1]``), not a constant: its loss and gradient change with the cut (the records below;
docs/findings/F24-seq-mean-token-sum-norm-width.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any
from unittest import mock

import torch
from tensordict import TensorDict

from ...protocol.known import KnownFailure, When
from ...cases.step import step_inputs
from ...protocol.step import Aggregation, Cut, CutPlan, Divisor, Fact, LossDeclaration, LossSetting, PerToken, StepLayer, \
    Weighting
from ..kit import require
from ..kit.step import AGG_LOSS_MODES, HORIZONS, agg_loss_losses, cut_with, with_plan

__all__ = ["verl_step_layer", "verl_forward_backward", "STEP_RECORDS", "width_default_applies",
           "a_sample_without_loss_tokens", "a_rank_runs_several_micro_batches"]

HOW = "pip install verl==0.9.1"
#: the PPO clip range of the drawn actor config (clip_ratio; clip_ratio_low/high left unset take it)
CLIP_RATIO = 0.2
#: ActorConfig's SAPO temperatures (tau_pos, tau_neg: its defaults)
SAPO_TAUS = (1.0, 1.05)
#: PolicyLossConfig.dro_beta of the drawn DRO config (required positive; no default)
DRO_BETA = 0.5
#: GMPO's objective (compute_policy_loss_geo_mean): each sequence's masked-mean advantage times the geometric mean of its
#: clipped token ratios (the cases' ratios lie inside the clip range: the sequence ratio), averaged over the sequences
#: with torch.mean whatever loss_agg_mode says; as the step's loss, the mean over the mini-batch's sequences
GEO_MEAN = Aggregation("seq-mean-token-mean", Weighting.SEQUENCE_MEAN, (Divisor.SEQUENCES,))
#: verl's policy_loss.loss_mode forms beside vanilla (the "policy" loss), each through ppo_loss and its registered
#: function: gspo (GSPO-token) and cispo (the stopped weight clipped to [1 - clip_ratio, 1 + clip_ratio]) in every
#: loss_agg_mode; sapo aggregates by seq-mean-token-mean whatever loss_agg_mode says (compute_policy_loss_sapo passes
#: it to agg_loss itself; "for SAPO, it is recommended to use seq-mean-token-mean"), so that is its one mode; gpg (the plain
#: policy gradient) and dro (its quadratic log-ratio penalty, dro_beta) in every loss_agg_mode; geo_mean (GMPO) in its
#: own aggregation, the mean over sequences, which ignores loss_agg_mode
POLICY_FORMS = (
    LossDeclaration("gspo", PerToken.SEQUENCE_RATIO_TOKEN, AGG_LOSS_MODES, horizons=HORIZONS),
    LossDeclaration("cispo", PerToken.CLIPPED_WEIGHT, AGG_LOSS_MODES, horizons=HORIZONS,
                    parameters={"low": 1.0 - CLIP_RATIO, "high": 1.0 + CLIP_RATIO}),
    LossDeclaration("sapo", PerToken.SOFT_GATE, tuple(m for m in AGG_LOSS_MODES if m.name == "seq-mean-token-mean"),
                    parameters={"tau_pos": SAPO_TAUS[0], "tau_neg": SAPO_TAUS[1]}, undrawn={
                        m.name: "compute_policy_loss_sapo aggregates by seq-mean-token-mean whatever loss_agg_mode "
                                "says" for m in AGG_LOSS_MODES if m.name != "seq-mean-token-mean"}),
    LossDeclaration("gpg", PerToken.POLICY_GRADIENT, AGG_LOSS_MODES, horizons=HORIZONS),
    LossDeclaration("dro", PerToken.QUADRATIC_PENALTY, AGG_LOSS_MODES, horizons=HORIZONS,
                    parameters={"beta": DRO_BETA}),
    LossDeclaration("geo_mean", PerToken.SEQUENCE_RATIO, (GEO_MEAN,), undrawn={
        m.name: "compute_policy_loss_geo_mean ignores loss_agg_mode (torch.mean over the sequences)"
        for m in AGG_LOSS_MODES if m.name != GEO_MEAN.name}),
)
#: the loss_mode forms not drawn, with why
UNDRAWN_POLICY_FORMS = {
    "dppo_tv, dppo_kl, bypass_mode": "anchored on the rollout's own log-probs (rollout_log_probs), which the step keys "
                                     "do not carry",
    "clip_cov, kl_cov": "pick tokens by the covariance of advantage and log-prob over the micro-batch (a random subset, "
                        "a top-k): the per-token loss depends on the micro-batch by design",
}


def width_default_applies(case: Any) -> bool:
    """seq-mean-token-sum-norm without a loss_scale_factor on a cut whose micro-batches are not all as wide as the
    mini-batch's longest response (a micro-batch of one cut covers its own longest response only)."""
    if getattr(case, "mode", None) != "seq-mean-token-sum-norm" or case.horizon is not None:
        return False
    return len(set(case.response_lens)) > 1 and (case.dp > 1 or case.cut == "tokens" or case.micro_batch_size
                                                 < case.per_rank)


#: verl 0.9.1's seq-mean-token-sum-norm default scale: the micro-batch's padded width
WIDTH_RECORDS = tuple(
    KnownFailure(invariant, "agg_loss's seq-mean-token-sum-norm without loss_scale_factor divides by "
                 "loss_mask.shape[-1], the micro-batch's padded width, so the loss and its gradient change with the cut "
                 "(docs/findings/F24-seq-mean-token-sum-norm-width.md)", matches=f"in seq-mean-token-sum-norm: {what}",
                 when=When("seq-mean-token-sum-norm without loss_scale_factor, responses of different lengths cut into "
                           "micro-batches or ranks", width_default_applies), certain=False)
    for invariant, what in (("INV-STEP-003", "the micro-batches' losses"), ("INV-STEP-004", "gradient")))


def a_sample_without_loss_tokens(case: Any) -> bool:
    """A distillation step whose mini-batch holds a sample with no loss token (its response mask all 0): a micro-batch
    of such samples only has nothing to take the min of."""
    if getattr(case, "loss", None) != "distillation" or not case.holes:
        return False
    inputs = step_inputs(case)
    valid = torch.zeros(case.batch_size).index_add_(0, inputs.sample, inputs.mask.to(torch.float32))
    return bool((valid == 0).any())


#: verl 0.9.1's forward_kl_topk metrics take student_mass[response_mask].min() of a micro-batch without loss tokens
EMPTY_MICRO_BATCH_RECORDS = tuple(
    KnownFailure(invariant, "compute_forward_kl_topk's metrics take the min of the micro-batch's masked student_mass, "
                 "which is empty when no response token of the micro-batch counts: the step raises "
                 "(docs/findings/F25-verl-distillation-empty-micro-batch.md; verl PR #7887, open)", raises=RuntimeError,
                 matches=r"min\(\): Expected reduction dim", certain=False,
                 when=When("a distillation step with a sample whose response mask is all 0", a_sample_without_loss_tokens))
    for invariant in ("INV-STEP-001", "INV-STEP-003", "INV-STEP-004"))

def a_rank_runs_several_micro_batches(case: Any) -> bool:
    """A geo_mean step whose ranks run more than one micro-batch: a count cut finer than a rank's share, or a token
    budget some rank's share exceeds (verl then agrees on at least two micro-batches on every rank)."""
    if getattr(case, "loss", None) != "geo_mean":
        return False
    if case.cut == "count":
        return case.micro_batch_size < case.per_rank
    lengths = case.seq_lens
    return any(sum(lengths[i] for i in case.rank_rows(rank)) > case.max_token_len for rank in range(case.dp))


#: verl 0.9.1's geo_mean: each micro-batch's own mean over its sequences, backpropagated as is
GEO_MEAN_RECORDS = tuple(
    KnownFailure(invariant, "compute_policy_loss_geo_mean (GMPO) ends with torch.mean over the micro-batch's sequences, "
                 "not agg_loss with the global batch facts, and forward_backward_batch backpropagates each micro-batch's "
                 "loss unscaled: k micro-batches per rank give k local means, about k times the mini-batch's loss "
                 "and gradient (docs/findings/F26-verl-geo-mean-micro-batch-mean.md; verl issue #7913, open; PRs #5614, "
                 "#7916)", matches=f"geo_mean loss in seq-mean-token-mean: {what}",
                 when=When("a geo_mean step whose ranks run more than one micro-batch", a_rank_runs_several_micro_batches),
                 certain=False)
    for invariant, what in (("INV-STEP-003", "the micro-batches' losses"), ("INV-STEP-004", "gradient")))

#: every record of verl's step
STEP_RECORDS = WIDTH_RECORDS + EMPTY_MICRO_BATCH_RECORDS + GEO_MEAN_RECORDS


@lru_cache(maxsize=64)
def _config(kind: str, mode: str, horizon: int | None, loss_mode: str = "vanilla") -> Any:
    configs = require("verl.workers.config", HOW)
    common = {"strategy": "fsdp", "ppo_mini_batch_size": 1, "ppo_micro_batch_size_per_gpu": 1, "rollout_n": 1,
              "loss_agg_mode": mode, "loss_scale_factor": horizon}
    if kind == "value":
        return configs.FSDPCriticConfig(**common, cliprange_value=0.5)
    return configs.FSDPActorConfig(**common, clip_ratio=CLIP_RATIO, entropy_coeff=0.0, use_kl_loss=False,
                                   tau_pos=SAPO_TAUS[0], tau_neg=SAPO_TAUS[1],
                                   policy_loss=configs.PolicyLossConfig(loss_mode=loss_mode, dro_beta=DRO_BETA))


@lru_cache(maxsize=8)
def _distillation_config(topk: int) -> Any:
    """verl's supervised top-K forward KL (``use_policy_gradient=False``: the KL aggregated by ``agg_loss``), its
    per-token clamp off (``loss_max_clamp=None``, "no clamping": the default 10 is a per-token transform, not the
    aggregation the step checks)."""
    configs = require("verl.workers.config", HOW)
    return configs.DistillationConfig(enabled=False, distillation_loss=configs.DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=topk, use_policy_gradient=False, loss_max_clamp=None,
        log_prob_min_clamp=None))


def _facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:  # noqa: ARG001 - the cut changes no fact
    tokens = sum(int(m.get("loss_mask").values().sum()) for m in minis)
    samples = sum(int(m.batch_size[0]) for m in minis)
    return [{"batch_num_tokens": tokens, "dp_size": len(minis), "global_batch_size": samples} for _ in minis]


def _sequence_loss_mask(mb: TensorDict) -> torch.Tensor:
    """SFT's loss mask over each whole sequence (zeros on the prompt, the response mask on the response), as verl's SFT
    dataset hands it: ``sft_loss`` rolls it left by one to align it with the log-probs."""
    ids, mask = mb.get("input_ids"), mb.get("response_mask")
    lengths, responses = ids.offsets().diff(), mask.offsets().diff()
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), responses)
    cols = torch.arange(int(responses.sum())) - mask.offsets()[:-1][rows]
    values = torch.zeros(int(lengths.sum()), dtype=mask.values().dtype)
    values[(ids.offsets()[1:] - responses)[rows] + cols] = mask.values()
    return torch.nested.nested_tensor_from_jagged(values, ids.offsets())


def _loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    losses, tu = require("verl.workers.utils.losses", HOW), require("verl.utils.tensordict_utils", HOW)
    data = mb.copy()
    tu.assign_non_tensor(data, **facts)
    if setting.loss == "sft":
        data.set("loss_mask", _sequence_loss_mask(mb))
        loss, _ = losses.sft_loss(_config("policy", setting.mode, setting.horizon), dict(outputs), data)
    elif setting.loss == "value":
        loss, _ = losses.value_loss(_config("value", setting.mode, setting.horizon), dict(outputs), data)
    elif setting.loss == "distillation":
        distill = require("verl.trainer.distillation.losses", HOW)
        loss, _ = distill.distillation_loss(_config("policy", setting.mode, setting.horizon),
                                            _distillation_config(int(mb.get("teacher_ids").values().shape[-1])),
                                            dict(outputs), data)
    else:
        loss_mode = setting.loss if setting.loss in {form.name for form in POLICY_FORMS} else "vanilla"
        loss, _ = losses.ppo_loss(_config("policy", setting.mode, setting.horizon, loss_mode), dict(outputs), data)
    return loss


def _restore(output_lst: list[dict], indices, mini: TensorDict) -> dict:
    utils = require("verl.workers.engine.utils", HOW)
    data = mini.copy()
    data.set_non_tensor("use_dynamic_bsz", indices is not None)
    return utils.postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)["model_output"]


class _StandIn:
    """The stand-in model where verl's ``forward_step`` calls ``self.module(**model_inputs, use_cache=False)``, with
    the ``config`` verl's preparation reads (spec/engines/verl/adapter.py sets it on the engine object)."""

    def __init__(self, model: Any, config: Any):
        self.model, self.config = model, config

    def __call__(self, **inputs: Any) -> Any:
        return self.model(**inputs)


def verl_forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                          processor) -> dict:  # noqa: ARG001 - verl reads its DP group off the world (world_is_dp)
    """One rank's step through verl's ``forward_backward_batch`` (see the module docstring for what is set)."""
    impl_module = require("verl.workers.engine.fsdp.transformer_impl", HOW)
    eng = obj.verl_engine
    eng.ulysses_device_mesh = None
    eng._autocast_dtype = torch.float32
    eng.module = _StandIn(model, eng.module.config)
    data = with_plan(mini, plan)
    if setting.loss == "sft":  # SFT's data carry a loss mask over each whole sequence (verl's SFT dataset)
        data.set("loss_mask", _sequence_loss_mask(data))
    require("verl.utils.tensordict_utils", HOW).assign_non_tensor(
        data, global_batch_size=plan.global_batch_size or None, return_model_output=True)

    def verl_loss(model_output=None, data=None, dp_group=None, student_logits=None, **kwargs):  # noqa: ARG001
        if student_logits is not None:  # called as the logits processor (distillation_ppo_loss's first role)
            return processor(student_logits=student_logits, data=data, **kwargs)
        return loss_function(model_output, data), {}

    balancing = require("verl.utils.seqlen_balancing", HOW)
    with mock.patch.object(impl_module, "get_device_id", lambda: "cpu"), \
            mock.patch.object(balancing, "get_device_name", lambda: "cpu"):
        return eng.forward_backward_batch(data, verl_loss, forward_only=False)["model_output"]


def verl_step_layer() -> StepLayer | None:
    """verl's step, where verl ships every loss function it declares (None otherwise: verl 0.7.1 has no
    ``verl.trainer.distillation``; its padded path is the mask failure of issue #6278 either way)."""
    try:
        utils = require("verl.workers.engine.utils", HOW)
        for module in ("verl.workers.utils.losses", "verl.trainer.distillation.losses"):
            require(module, HOW)
    except ImportError:
        return None
    return StepLayer("verl", cuts=(Cut.COUNT, Cut.TOKENS), facts=(Fact.BATCH_NUM_TOKENS, Fact.DP_SIZE,
                                                                  Fact.GLOBAL_BATCH_SIZE),
                     losses=(*agg_loss_losses(), *POLICY_FORMS),
                     functions={"cut": cut_with(utils.prepare_micro_batches), "facts": _facts, "loss": _loss,
                                "restore": _restore, "forward_backward": verl_forward_backward},
                     dp_sizes=(1, 2, 4), world_is_dp=True)
