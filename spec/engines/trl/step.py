"""TRL 1.16's GRPO step as a step layer: every ``loss_type``'s aggregation through ``GRPOTrainer._compute_loss`` itself.

TRL cuts a process's generation batch into ``steps_per_generation`` consecutive chunks of ``per_device_train_batch_size``
samples (``split_tensor_dict``, TRL's own, called here), one per gradient-accumulation step, so every micro-batch holds
the same number of samples (a COUNT cut, equal micro-batches; ``steps_per_generation`` = ``gradient_accumulation_steps``, TRL's default).
Each micro-batch is handed ``num_items_in_batch`` (the generation batch's loss tokens over every process:
``accelerator.gather(loss_mask.sum()).sum()``), ``current_gradient_accumulation_steps`` and
``accelerator.num_processes``. The loss is TRL's own ``GRPOTrainer._compute_loss``, called unbound on a trainer that
holds only what it reads (the loss type, its clip range, the accumulation steps, ``max_completion_length``, an
accelerator of ``dp`` processes), whose ``_get_per_token_logps_and_entropies`` returns the engine's completion
log-probs (TRL's own preparation: the ``trl`` engine, spec/engines/trl.py), so every aggregation line that runs is
TRL's. There is no restore: the order is kept (the micro-batches' outputs are concatenated).

The loss types, as GRPOConfig documents them: ``grpo`` (each sequence's token mean, averaged over the micro-batch,
divided by the accumulation steps: the global sequence mean, the micro-batches being equal), ``bnpo`` (the micro-batch's
own token count: *documented* local, "normalization is performed over the local batch only"), ``dr_grpo`` (a global
constant, ``max_completion_length`` times the samples), ``dapo`` (the token count of the global accumulated batch),
``luspo`` (each sequence's token sum, averaged; GSPO's sequence-level ratio, ``importance_sampling_level="sequence"``),
and ``cispo``, ``sapo``, ``vespo``, which aggregate as ``dapo``, ``grpo`` and ``dapo`` do, with per-token forms of their
own (the clipped, stopped importance weight times the log-prob; the soft sigmoid gate; the Gamma weight of the
sequence's ratio: spec.protocol.step.PerToken), at GRPOConfig's documented settings (CISPO's cap ``epsilon_high`` both
at its recommended 5.0 and unset, when it is ``epsilon``).
"""

from __future__ import annotations

from functools import lru_cache

from collections import defaultdict
from types import SimpleNamespace

import torch
from tensordict import TensorDict

from ...cases.materialize import select_rows
from ...protocol.engine import response_view
from ...protocol.step import (Aggregation, Cut, CutPlan, Divisor, Fact, LossDeclaration, LossSetting, PerToken, Scope,
                             StepLayer, Weighting)
from ..kit import require
from ..kit.step import concatenated, sequence_values

__all__ = ["trl_step_layer", "GRPO_LOSSES"]

HOW = "pip install trl==1.16.0"
DOCUMENTED_BNPO = ("GRPOConfig.loss_type 'bnpo': 'normalizing with the number of active token in the local batch ... "
                   "normalization is performed over the local batch only'")
#: max_completion_length, dr_grpo's constant
MAX_COMPLETION_LENGTH = 16

#: the clip range of the ratio losses (GRPOConfig's epsilon; epsilon_high unset takes it)
EPSILON = 0.2
_SEQUENCE_MEAN = (Weighting.SEQUENCE_MEAN, (Divisor.SEQUENCES,))
_GLOBAL_TOKENS = (Weighting.TOKEN, (Divisor.TOKENS,))

GRPO_LOSSES = (
    LossDeclaration("grpo", PerToken.RATIO, (
        Aggregation("grpo", *_SEQUENCE_MEAN),
        Aggregation("bnpo", Weighting.TOKEN, (Divisor.TOKENS,), Scope.MICRO_BATCH, documented=DOCUMENTED_BNPO),
        Aggregation("dr_grpo", Weighting.TOKEN, (Divisor.SEQUENCES, Divisor.HORIZON)),
        Aggregation("dapo", *_GLOBAL_TOKENS)), horizons=(MAX_COMPLETION_LENGTH,)),
    LossDeclaration("luspo", PerToken.SEQUENCE_RATIO, (Aggregation("luspo", Weighting.TOKEN, (Divisor.SEQUENCES,)),)),
    # CISPO's cap is epsilon_high (no lower bound: a ratio is positive): GRPOConfig documents 5.0 for it ("the
    # recommended value"); left unset it is epsilon, 0.2, below any on-policy ratio, so every weight is clipped (both)
    LossDeclaration("cispo", PerToken.CLIPPED_WEIGHT, (Aggregation("cispo", *_GLOBAL_TOKENS),), parameters={"low": 0.0, "high": 5.0}),
    LossDeclaration("cispo@epsilon", PerToken.CLIPPED_WEIGHT, (Aggregation("cispo", *_GLOBAL_TOKENS),),
                    parameters={"low": 0.0, "high": EPSILON}),
    LossDeclaration("sapo", PerToken.SOFT_GATE, (Aggregation("sapo", *_SEQUENCE_MEAN),),
                    parameters={"tau_pos": 1.0, "tau_neg": 1.05}),  # GRPOConfig's sapo_temperature_pos/_neg
    LossDeclaration("vespo", PerToken.GAMMA_WEIGHT, (Aggregation("vespo", *_GLOBAL_TOKENS),),  # GRPOConfig's vespo_*
                    parameters={"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}),
)
_DECLARED = {loss.name: loss for loss in GRPO_LOSSES}


#: why TRL's ranks run in one process: its step has no collective; the one fact it all-reduces is made at generation
IN_PROCESS = ("TRL's step (split_tensor_dict's cut, _compute_loss) runs no collective: its one global fact, "
              "num_items_in_batch, is accelerator.gather(loss_mask.sum()).sum() in _generate_and_score_completions, "
              "the generation that precedes the step (a vLLM or model.generate rollout, not run here): stated here as "
              "that gather's sum, and accelerator.num_processes as the DP size")


def _split_cut(minis: list[TensorDict], plan: CutPlan) -> list:
    """Each process's generation batch cut by TRL's own ``split_tensor_dict`` into ``steps_per_generation`` chunks
    (the batch over ``per_device_train_batch_size``): TRL decides which samples each micro-batch holds (it is handed
    the samples' indices, as it slices every key alike), the suite assembles each micro-batch's keys for them."""
    utils = require("trl.trainer.utils", HOW)
    out = []
    for mini in minis:
        size = int(mini.batch_size[0])
        chunks = utils.split_tensor_dict({"index": torch.arange(size)}, max(1, size // plan.micro_batch_size))
        out.append(([select_rows(mini, chunk["index"].tolist()) for chunk in chunks], None))
    return out


def _facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:
    items = sum(int(m.get("response_mask").values().sum()) for m in minis)
    steps = -(-int(minis[0].batch_size[0]) // plan.micro_batch_size)
    return [{"num_items_in_batch": items, "accumulation_steps": steps, "num_processes": len(minis)} for _ in minis]


def _trainer(setting: LossSetting, facts: dict, log_probs: torch.Tensor) -> SimpleNamespace:
    """What ``_compute_loss`` reads of its trainer (GRPOConfig's defaults otherwise)."""
    steps = facts["accumulation_steps"]
    p = _DECLARED[setting.loss].parameters
    identity = lambda tensor, *args, **kwargs: tensor  # noqa: E731 - one process's view of a collective
    return SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (log_probs, torch.zeros_like(log_probs.detach()), None),
        loss_type=setting.mode, epsilon_low=EPSILON, epsilon_high=p.get("high", EPSILON), beta=0.0,
        top_entropy_quantile=1.0,
        importance_sampling_level="sequence" if setting.loss == "luspo" else "token", off_policy_mask_threshold=None,
        use_vllm=False, vllm_importance_sampling_correction=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=steps,
        max_completion_length=setting.horizon or MAX_COMPLETION_LENGTH, model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=steps,
                             sapo_temperature_pos=p.get("tau_pos"), sapo_temperature_neg=p.get("tau_neg"),
                             **{f"vespo_{key}": p.get(key) for key in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}),
        accelerator=SimpleNamespace(num_processes=facts["num_processes"], gather=identity, reduce=identity,
                                    gather_for_metrics=identity, sync_gradients=True),
        _metrics=defaultdict(lambda: defaultdict(list)))


def _loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    grpo = require("trl.trainer.grpo_trainer", HOW).GRPOTrainer
    log_probs, completion_mask = response_view(outputs["log_probs"], mb)
    width = log_probs.shape[1]
    padded = {key: response_view(sequence_values(mb, key), mb, width)[0]
              for key in ("response_mask", "old_log_probs", "advantages")}
    batch = log_probs.shape[0]
    inputs = {"prompt_ids": torch.zeros(batch, 1, dtype=torch.int64), "prompt_mask": torch.ones(batch, 1,
                                                                                              dtype=torch.int64),
              "completion_ids": torch.zeros(batch, width, dtype=torch.int64),
              "completion_mask": completion_mask.to(torch.int64), "tool_mask": padded["response_mask"].to(torch.int64),
              "advantages": padded["advantages"], "old_per_token_logps": padded["old_log_probs"],
              "num_items_in_batch": torch.tensor(float(facts["num_items_in_batch"]))}
    trainer = _trainer(setting, facts, log_probs)
    trainer.get_gamma_weights = grpo.get_gamma_weights  # VESPO's weights, a static method of TRL's
    return grpo._compute_loss(trainer, None, inputs)


@lru_cache(maxsize=None)
def trl_step_layer() -> StepLayer | None:
    """TRL's GRPO step (None where TRL's GRPO trainer does not import)."""
    try:
        require("trl.trainer.grpo_trainer", HOW)
    except ImportError:
        return None
    return StepLayer("trl", cuts=(Cut.COUNT,), facts=(Fact.BATCH_NUM_TOKENS, Fact.ACCUMULATION_STEPS, Fact.DP_SIZE),
                     losses=GRPO_LOSSES, functions={"cut": _split_cut, "facts": _facts, "loss": _loss, "restore": concatenated},
                     dp_sizes=(1, 2), equal_micro_batches=True, in_process=IN_PROCESS,
                     restated={"restore": "TRL restores nothing: the order is kept, the completions' outputs "
                                          "concatenated (kit.step.concatenated)"})

