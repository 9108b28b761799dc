"""skyrl 0.4.0's policy step as a step layer: advantages pre-scaled over the mini-batch, its policy losses summing.

SkyRL 0.4.0 (PR #1296, the fix of issue #794 that skyrl-train 0.3.1's records in step.py name) moves the loss
reduction out of the micro-batch: the trainer (``RayPPOTrainer``, before it dispatches a mini-batch to the DP ranks)
scales each mini-batch's advantages with ``apply_loss_reduction_to_advantages_minibatch`` so that a plain sum gives the
mode's reduction, ``token_mean`` ``A / (the mini-batch's loss tokens)``, ``sequence_mean`` ``A / (B * n_i)``,
``seq_mean_token_sum_norm`` ``A / (B * max_seq_len)`` (``B`` the mini-batch's samples on every rank); the worker cuts
its share into consecutive micro-batches (``BatchIterator``), takes ``ppo_policy_loss`` (the PPO clip, then
``reduce_loss``: a masked **sum**) and backpropagates ``policy_loss * dp_size`` (``grad_sum_correction_factor``:
DDP/FSDP average the ranks' gradients). The loss function is skyrl 0.4.0's own (``skyrl.backends.skyrl_train.utils.
ppo_utils``, imported with the adapter's stubs); the pre-scaling is the trainer's, stated here per micro-batch from
the mini-batch's facts (the loss tokens and samples of every rank), as ``apply_loss_reduction_to_advantages_minibatch``
takes the whole mini-batch, which a micro-batch's loss is not handed. Every policy loss drawn (``regular``,
``dual_clip``, ``importance_sampling``, ``gspo``, ``sapo``, ``cispo``) is linear in the advantages for a positive scale
(``-min(r A, clip(r) A)``; SAPO's gate temperature reads only A's sign), so pre-scaling and reducing after are the same
loss.

``token_mean_legacy`` (the old per-micro-batch behaviour, kept for comparison) is drawn as the local mode it is
documented to be: each micro-batch's own token mean, averaged over the mini-batch's micro-batches. ``prompt_mean``
(each prompt group's token mean, averaged over the prompts: ``A / (num_prompts * the group's loss tokens)``) is drawn
with prompt groups of any sizes, straddling ranks and micro-batches: the trainer's ``prompt_boundaries`` come from the
samples' ``uid`` through skyrl's own ``compute_prompt_boundaries`` (``skyrl.train.dataset.preprocess``), over the
whole mini-batch. tests/test_step_engines.py holds :func:`prescaled` to the library's
``apply_loss_reduction_to_advantages_minibatch`` on whole mini-batches, in every mode.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import torch
from tensordict import TensorDict

from ...protocol.step import (PROMPT_KEY, Aggregation, Cut, CutPlan, Divisor, Fact, LossSetting, Scope, StepLayer,
                              Weighting)
from ..kit.step import concatenated, consecutive_cut, policy_columns
from .step import COVARIANCE_PICKED, LOSS_FUNCTIONS, MAX_SEQ_LEN, SKYRL_AGGREGATIONS, policy_losses

__all__ = ["skyrl_step_layer", "PPO_UTILS"]

#: the module of skyrl 0.4.0's policy losses (the adapter imports it with its stubs: spec/engines/skyrl/adapter.py)
PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"
#: SAPOConfig's temperatures and CISPOConfig's offsets from 1 (skyrl.train.config's defaults; cispo_anchor "old")
SAPO_TAUS, CISPO_OFFSETS = (1.0, 1.05), (1.0, 4.0)
#: the pre-fix token mean, kept as a mode of its own: documented local
LEGACY = Aggregation("token_mean_legacy", Weighting.TOKEN, (Divisor.TOKENS,), Scope.MICRO_BATCH,
                     documented="apply_loss_reduction_to_advantages_minibatch: 'legacy token-mean that normalizes "
                                "per-microbatch then averages across microbatches'")
#: each prompt group's token mean, averaged over the mini-batch's prompts (PR #1296's fourth mode)
PROMPT_MEAN = Aggregation("prompt_mean", Weighting.PROMPT_MEAN, (Divisor.PROMPTS,))
#: where the trainer's prompt boundaries come from (skyrl 0.4.0's, imported by the adapter's load())
PREPROCESS = "skyrl.train.dataset.preprocess"
_UNDRAWN_LOSSES = {
    "rollout_is, dppo, cispo with cispo_anchor='rollout'": "policy_loss_types anchored on the rollout's own log-probs, "
                                                           "which the suite's step keys do not carry",
    **COVARIANCE_PICKED,
    "cross_entropy": "SFT's plain sum of -log_prob (Tinker's SUM semantics), which ignores the advantages and so every "
                     "loss_reduction's pre-scaling",
}
#: the same modes as 0.3.1's (step.py), seq_mean_token_sum_norm's constant trainer.algorithm.max_seq_len; every
#: policy_loss_type whose per-token form is linear in the advantages (so pre-scaling them is the reduction)
LOSSES = policy_losses(SAPO_TAUS, CISPO_OFFSETS, _UNDRAWN_LOSSES, more=("importance_sampling",),
                       aggregations=(*SKYRL_AGGREGATIONS, PROMPT_MEAN, LEGACY))


@lru_cache(maxsize=32)
def _config(loss: str, mode: str, horizon: int | None) -> Any:
    config = importlib.import_module("skyrl.train.config")
    return config.AlgorithmConfig(policy_loss_type="regular" if loss == "policy" else loss, loss_reduction=mode,
                                  eps_clip_low=0.2, eps_clip_high=0.2, max_seq_len=horizon or MAX_SEQ_LEN,
                                  sapo=config.SAPOConfig(tau_pos=SAPO_TAUS[0], tau_neg=SAPO_TAUS[1]),
                                  cispo=config.CISPOConfig(cispo_eps_clip_low=CISPO_OFFSETS[0],
                                                           cispo_eps_clip_high=CISPO_OFFSETS[1]))


def _row_sums(nested: torch.Tensor) -> torch.Tensor:
    """Each row's sum of a jagged ``(b, j)`` tensor, from its values and offsets (no loop over the rows)."""
    totals = torch.cat([nested.values().new_zeros(1), nested.values().cumsum(0)])
    offsets = nested.offsets()
    return totals[offsets[1:]] - totals[offsets[:-1]]


def _prompt_groups(minis: list[TensorDict]) -> dict[int, float] | None:
    """Each prompt's loss tokens over the mini-batch (every rank's share), by its id, from the trainer's
    ``prompt_boundaries`` (skyrl's own ``compute_prompt_boundaries`` of the samples' uids); None without uids."""
    if any(PROMPT_KEY not in mini.keys() for mini in minis):
        return None
    uids = torch.cat([mini.get(PROMPT_KEY) for mini in minis])
    tokens = torch.cat([_row_sums(mini.get("response_mask")) for mini in minis])
    boundaries = importlib.import_module(PREPROCESS).compute_prompt_boundaries([str(int(u)) for u in uids])
    return {int(uids[start]): float(tokens[start:end].sum()) for start, end in boundaries}


def _facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:
    """The trainer's mini-batch (every rank's share): its loss tokens, its samples, the DP size, its micro-batches
    (``token_mean_legacy``'s count: the mini-batch's samples over ``micro_train_batch_size_per_gpu``) and its prompt
    groups' loss tokens (``prompt_mean``'s)."""
    tokens = sum(float(mini.get("response_mask").values().sum()) for mini in minis)
    samples = sum(int(mini.batch_size[0]) for mini in minis)
    return [{"batch_num_tokens": tokens, "global_batch_size": samples, "dp_size": len(minis),
             "micro_batches": samples // plan.micro_batch_size, "prompt_groups": _prompt_groups(minis)}
            for _ in minis]


def prescaled(advantages: torch.Tensor, mask: torch.Tensor, facts: dict, setting: LossSetting,
              uids: torch.Tensor | None = None) -> torch.Tensor:
    """``apply_loss_reduction_to_advantages_minibatch`` of the micro-batch's rows ``(b, R)``, with the mini-batch's
    facts (``uids``: the rows' prompt ids, ``prompt_mean``'s)."""
    if setting.mode == "prompt_mean":
        groups = facts["prompt_groups"]
        if groups is None or uids is None:
            raise ValueError(f"prompt_mean: the micro-batch's rows need their prompt ids ({PROMPT_KEY!r}), got none")
        ids = torch.tensor(list(groups), dtype=uids.dtype)
        counts = torch.tensor(list(groups.values()), dtype=advantages.dtype)
        found = uids.unsqueeze(-1) == ids  # (b, prompts): each row's own group
        if not bool(found.any(-1).all()):
            raise ValueError(f"prompt_mean: prompt ids {uids.tolist()} of the micro-batch, not all among the "
                             f"mini-batch's {list(groups)}")
        own = counts[found.int().argmax(-1)].clamp(min=1).unsqueeze(-1)
        return advantages / (len(groups) * own)
    if setting.mode == "token_mean":
        return advantages / max(facts["batch_num_tokens"], 1.0)
    if setting.mode == "token_mean_legacy":  # the micro-batch's own loss tokens, over the mini-batch's micro-batches
        return advantages / (mask.sum().clamp(min=1) * facts["micro_batches"])
    if setting.mode == "sequence_mean":
        return advantages / (facts["global_batch_size"] * mask.sum(dim=-1, keepdim=True).clamp(min=1))
    return advantages / (facts["global_batch_size"] * (setting.horizon or MAX_SEQ_LEN))


def _loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    ppo = importlib.import_module(PPO_UTILS)
    log_probs, mask, old, advantages = policy_columns(outputs, mb)
    policy_loss = getattr(ppo, LOSS_FUNCTIONS[setting.loss])
    uids = mb.get(PROMPT_KEY) if PROMPT_KEY in mb.keys() else None
    loss, _ = policy_loss(log_probs, old, prescaled(advantages, mask, facts, setting, uids),
                          _config(setting.loss, setting.mode, setting.horizon), loss_mask=mask)
    return loss * facts["dp_size"]  # the worker's grad_sum_correction_factor


@lru_cache(maxsize=None)
def skyrl_step_layer(load) -> StepLayer | None:
    """skyrl 0.4.0's policy step, its loss function imported by ``load()`` (the adapter's modules, with its stubs);
    None where it does not import. One per adapter (cached by its bound ``load``)."""
    try:
        load()
        importlib.import_module(PPO_UTILS)
    except ImportError:
        return None
    # GSPO's and SAPO's advice to reduce by sequence_mean, logged on every call: the suite draws every reduction
    importlib.import_module("loguru").logger.disable(PPO_UTILS)
    return StepLayer("skyrl", cuts=(Cut.COUNT,), facts=(Fact.BATCH_NUM_TOKENS, Fact.GLOBAL_BATCH_SIZE, Fact.DP_SIZE,
                                                Fact.PROMPT_GROUPS),
                     losses=LOSSES, functions={"cut": consecutive_cut, "facts": _facts, "loss": _loss,
                                               "restore": concatenated},
                     dp_sizes=(1, 2),
                     restated={"cut": "BatchIterator's TrainingInputBatch.chunk, consecutive chunks "
                                      "(kit.step.consecutive_cut): skyrl's own takes its TrainingInputBatch",
                               "restore": "the order is kept, the outputs concatenated (kit.step.concatenated)"},
                     in_process="skyrl 0.4.0's policy step runs no collective: the trainer pre-scales the advantages "
                                "over the whole mini-batch before it dispatches the ranks' shares (the facts), the "
                                "worker multiplies by dp_size; DDP/FSDP's gradient average is the suite's mean of the "
                                "ranks' gradients")
