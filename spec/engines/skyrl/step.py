"""skyrl-train 0.3.1's policy step as a step layer: its policy losses (``regular``, ``dual_clip``, ``gspo``, ``sapo``,
``cispo``) and their ``reduce_loss`` in every ``loss_reduction``.

SkyRL's worker cuts a mini-batch on each rank into consecutive micro-batches of ``micro_train_batch_size_per_gpu``
(``BatchIterator``, ``drop_last=False``), computes each micro-batch's policy loss with ``ppo_policy_loss`` (the PPO clip
over the response columns, ``reduce_loss`` by ``config.loss_reduction``) and backpropagates ``loss /
accumulation_steps`` (``PolicyWorkerBase.forward_backward``); DDP/FSDP average the ranks. The loss functions are
skyrl-train's own (imported after the adapter's stubs, spec/engines/skyrl.py); the division by the accumulation steps
is the worker's one line, stated here.

``reduce_loss``' modes: ``token_mean`` (a masked mean over the micro-batch's tokens), ``sequence_mean`` (each sequence's
token mean, averaged over the micro-batch) and ``seq_mean_token_sum_norm`` (each sequence's token sum over the constant
``max_seq_len``, averaged). With equal micro-batches the last two are the mini-batch's; ``token_mean`` is not: each
micro-batch divides by its own tokens, so the gradient depends on the cut (the records below; SkyRL issue #794, fixed by
PR #1296 in skyrl 0.4.0, which keeps the old behaviour as ``token_mean_legacy``, "normalizes per-microbatch then averages
across microbatches"). skyrl 0.4.0's reduction (advantages pre-scaled over the mini-batch) is not declared here.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import torch
from tensordict import TensorDict

from ...protocol.known import KnownFailure, When
from ...protocol.step import (Aggregation, Cut, CutPlan, Divisor, Fact, LossDeclaration, LossSetting, PerToken,
                             StepLayer, Weighting)
from ..kit.step import concatenated, consecutive_cut, policy_columns

__all__ = ["skyrl_train_step_layer", "SKYRL_STEP_RECORDS", "SKYRL_AGGREGATIONS", "MAX_SEQ_LEN", "token_counts_differ",
           "policy_losses", "LOSS_FUNCTIONS", "COVARIANCE_PICKED"]

#: reduce_loss' max_seq_len (the generator's max input + generate length), seq_mean_token_sum_norm's constant
MAX_SEQ_LEN = 16

#: SkyRL's loss_reduction modes, which every policy_loss_type reduces by (0.3.1's and 0.4.0's:
#: spec/engines/skyrl/prescaled_step.py)
SKYRL_AGGREGATIONS = (Aggregation("token_mean", Weighting.TOKEN, (Divisor.TOKENS,)),
                      Aggregation("sequence_mean", Weighting.SEQUENCE_MEAN, (Divisor.SEQUENCES,)),
                      Aggregation("seq_mean_token_sum_norm", Weighting.TOKEN, (Divisor.SEQUENCES, Divisor.HORIZON)))
#: the policy_loss_types whose per-token loss is linear in the advantages, and their functions (both versions' names;
#: the registry's lookup goes through a ray actor)
LOSS_FUNCTIONS = {"policy": "ppo_policy_loss", "dual_clip": "ppo_policy_loss", "gspo": "gspo_policy_loss",
                  "sapo": "sapo_policy_loss", "cispo": "compute_policy_loss_cispo",
                  "importance_sampling": "importance_sampling_loss"}
#: clip_cov and kl_cov, in both versions
COVARIANCE_PICKED = {
    "clip_cov, kl_cov": "policy_loss_types that pick tokens by the covariance of advantage and log-prob over the "
                        "micro-batch (clip_cov a random subset by torch.randperm, kl_cov a top-k): the per-token loss "
                        "depends on the micro-batch by design, outside the oracle's forms"}


def policy_losses(sapo_taus: tuple[float, float], cispo_offsets: tuple[float, float], undrawn: dict[str, str],
                  more: tuple[str, ...] = (), aggregations: tuple[Aggregation, ...] = SKYRL_AGGREGATIONS
                  ) -> tuple[LossDeclaration, ...]:
    """SkyRL's policy losses in every reduction: ``regular`` (``policy``, carrying ``undrawn``), ``dual_clip`` (its
    extra bound, -A * clip_ratio_c for A < 0, binds only past a ratio of 3.0: the regular form inside the clip range
    the cases draw), ``gspo`` (GSPO-token), ``sapo`` (its temperatures), ``cispo`` (the weight clipped to
    [1 - low offset, 1 + high offset]), and ``more`` of the regular ratio's form."""
    def declared(name, form, **parameters):
        return LossDeclaration(name, form, aggregations, horizons=(MAX_SEQ_LEN,), parameters=parameters,
                               undrawn=undrawn if name == "policy" else {})
    return (declared("policy", PerToken.RATIO), declared("dual_clip", PerToken.RATIO),
            *(declared(name, PerToken.RATIO) for name in more), declared("gspo", PerToken.SEQUENCE_RATIO_TOKEN),
            declared("sapo", PerToken.SOFT_GATE, tau_pos=sapo_taus[0], tau_neg=sapo_taus[1]),
            declared("cispo", PerToken.CLIPPED_WEIGHT, low=1.0 - cispo_offsets[0], high=1.0 + cispo_offsets[1]))


#: ppo_base_config.yaml's defaults: sapo.tau_pos/tau_neg, cispo.cispo_eps_clip_low/high (offsets from 1)
SAPO_TAUS, CISPO_OFFSETS = (1.0, 1.05), (0.0, 5.0)
SKYRL_LOSSES = policy_losses(SAPO_TAUS, CISPO_OFFSETS, COVARIANCE_PICKED)


def token_counts_differ(case: Any) -> bool:
    """token_mean on a cut of two or more micro-batches (or ranks): they may hold different numbers of loss tokens."""
    return getattr(case, "mode", None) == "token_mean" and (case.dp > 1 or case.micro_batch_size < case.per_rank)


#: skyrl-train 0.3.1's token_mean: each micro-batch normalised by its own loss tokens
SKYRL_STEP_RECORDS = tuple(
    KnownFailure(invariant, "reduce_loss's token_mean divides each micro-batch's loss by its own loss tokens and the "
                 "worker averages the micro-batches (loss / accumulation_steps), so the loss and its gradient change "
                 "with the cut (SkyRL issue #794; fixed by PR #1296 in skyrl 0.4.0, the old behaviour kept as "
                 "token_mean_legacy)", matches=f"in token_mean: {what}",
                 when=When("token_mean on two or more micro-batches or ranks", token_counts_differ), certain=False)
    for invariant, what in (("INV-STEP-003", "the micro-batches' losses"), ("INV-STEP-004", "gradient")))


@lru_cache(maxsize=32)
def _config(loss: str, mode: str, horizon: int | None) -> Any:
    omegaconf = importlib.import_module("omegaconf")
    return omegaconf.OmegaConf.create({"policy_loss_type": "regular" if loss == "policy" else loss,
                                       "loss_reduction": mode, "eps_clip_low": 0.2, "eps_clip_high": 0.2,
                                       "clip_ratio_c": 3.0, "use_tis": False, "max_seq_len": horizon or MAX_SEQ_LEN,
                                       "sapo": {"tau_pos": SAPO_TAUS[0], "tau_neg": SAPO_TAUS[1]},
                                       "cispo": {"cispo_eps_clip_low": CISPO_OFFSETS[0],
                                                 "cispo_eps_clip_high": CISPO_OFFSETS[1]}})


def _facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:
    steps = -(-int(minis[0].batch_size[0]) // plan.micro_batch_size)
    return [{"accumulation_steps": steps, "dp_size": len(minis)} for _ in minis]


def _loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    ppo = importlib.import_module("skyrl_train.utils.ppo_utils")
    log_probs, mask, old, advantages = policy_columns(outputs, mb)
    policy_loss = getattr(ppo, LOSS_FUNCTIONS[setting.loss])
    loss, _ = policy_loss(log_probs, old, advantages, _config(setting.loss, setting.mode, setting.horizon), loss_mask=mask)
    return loss / facts["accumulation_steps"]  # PolicyWorkerBase.forward_backward


@lru_cache(maxsize=None)
def skyrl_train_step_layer(load) -> StepLayer | None:
    """skyrl-train's policy step, its loss functions imported after ``load()`` (the adapter's stubs of ray and the
    model packages); None where they do not import. One per adapter (cached by its bound ``load``)."""
    try:
        load()
        importlib.import_module("skyrl_train.utils.ppo_utils")
    except ImportError:
        return None
    # GSPO's and SAPO's advice to reduce by sequence_mean, logged on every call: the suite draws every reduction
    importlib.import_module("loguru").logger.disable("skyrl_train.utils.ppo_utils")
    return StepLayer("skyrl-train", cuts=(Cut.COUNT,), facts=(Fact.ACCUMULATION_STEPS, Fact.DP_SIZE),
                     losses=SKYRL_LOSSES, functions={"cut": consecutive_cut, "facts": _facts, "loss": _loss,
                                                     "restore": concatenated},
                     dp_sizes=(1, 2), equal_micro_batches=True,
                     restated={"cut": "BatchIterator's TrainingInputBatch.chunk, consecutive chunks "
                                      "(kit.step.consecutive_cut): skyrl-train's own takes its TrainingInputBatch",
                               "restore": "the order is kept, the outputs concatenated (kit.step.concatenated)"},
                     in_process="skyrl-train 0.3.1's policy step (BatchIterator's cut, ppo_policy_loss, loss / "
                                "accumulation_steps) runs no collective: no fact of the step is reduced over the DP "
                                "group (its token_mean is each micro-batch's own, the records below); DDP/FSDP's "
                                "gradient average is the suite's mean of the ranks' gradients")
