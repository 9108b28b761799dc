"""OpenRLHF 0.11.2's PPO actor step as a step layer: ``openrlhf.models.loss.PolicyLoss`` in both of its aggregations,
normalised as ``PPOActor.ppo_train`` normalises it (``openrlhf.utils.loss_utils.iter_grad_accum_global_norm``).

OpenRLHF's actor cuts each rank's share into consecutive micro-batches of ``micro_train_batch_size`` (its replay
buffer's ``DataLoader``; ``shuffle=False`` here, the order the suite checks), groups them into windows of
``accumulated_gradient`` (gas) micro-batches, one optimizer step each, and hands every micro-batch of a window the
same normalisers, ``_optimizer_step_loss_norm``: the window's loss tokens and non-empty samples summed over the window
and **all-reduced over the DP group** (its strategy's ``ds_device_mesh["dp"]``, else the default group), divided by
gas, and the DP group's size. ``PolicyLoss.forward`` aggregates with ``aggregate_loss``: ``token_level_loss=True``
(the default) ``sum(loss * mask) / batch_num_tokens * dp_size``; ``False`` each sequence's token mean summed over the
non-empty sequences, ``/ global_batch_size * dp_size`` (GSPO forces it). DeepSpeed's ``engine.backward`` scales every
micro-batch's loss by ``1 / gas`` (``scale_wrt_gas``, the one line stated here: DeepSpeed is not installed), and
DeepSpeed/DDP average the ranks' gradients.

On real ranks (DP > 1) the step is OpenRLHF's own ``iter_grad_accum_global_norm`` on a strategy without a device
mesh (its DP group is then the world: ``world_is_dp``), each micro-batch through OpenRLHF's ``Actor.forward``
(spec/engines/openrlhf/adapter.py) and the stand-in model, ``PolicyLoss`` handed the facts the ranks all-reduced.
At DP = 1 the same ``_optimizer_step_loss_norm`` runs in one process (no process group: no all-reduce).

Declared losses: ``ppo`` (``policy_loss_type="ppo"``, the clip range 0.2, no dual clip: the ratio stays inside it)
in ``token`` and ``sequence`` aggregation, ``gspo`` (the sequence-level ratio; sequence aggregation only), and the
critic's ``value`` (``PPOCritic.training_step``: ``ValueLoss(value_clip)`` on OpenRLHF's own critic forward,
spec/engines/openrlhf/critic.py, normalised by the same windows; always token-level, as ``PPOCritic`` never sets
``token_level_loss``). Not drawn: the dynamic-batch path (the replay buffer's token-balanced partitions and per-step
normalisers, ``setup_dynamic_batch``).
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

import torch
from tensordict import TensorDict

from ...protocol.engine import response_view
from ...protocol.step import (Aggregation, Cut, CutPlan, Divisor, Fact, LossDeclaration, LossSetting, PerToken,
                              StepLayer, Weighting)
from .library import openrlhf_modules
from ..kit.step import concatenated, consecutive_cut, policy_columns, sequence_values

__all__ = ["openrlhf_step_layer", "OPENRLHF_LOSSES"]

TOKEN_LEVEL = Aggregation("token", Weighting.TOKEN, (Divisor.TOKENS,))
SEQUENCE_LEVEL = Aggregation("sequence", Weighting.SEQUENCE_MEAN, (Divisor.VALID_SEQUENCES,))
OPENRLHF_LOSSES = (
    LossDeclaration("ppo", PerToken.RATIO, (TOKEN_LEVEL, SEQUENCE_LEVEL)),
    LossDeclaration("gspo", PerToken.SEQUENCE_RATIO, (SEQUENCE_LEVEL,),
                    undrawn={"token": "PolicyLoss sets token_level_loss=False for gspo"}),
    LossDeclaration("value", PerToken.VALUE, (TOKEN_LEVEL,), head="value",
                    undrawn={"sequence": "PPOCritic builds ValueLoss(value_clip): token_level_loss is never set, the "
                                         "critic's loss is always token-level"}),
)
#: the critic's value clip (PPOCritic's ValueLoss(value_clip); the old values lie inside it)
VALUE_CLIP = 0.5
#: the facts a micro-batch is handed (its non-tensor entries on real ranks)
FACTS = (Fact.BATCH_NUM_TOKENS, Fact.GLOBAL_BATCH_SIZE, Fact.DP_SIZE, Fact.ACCUMULATION_STEPS)


def _action_mask(mb: TensorDict) -> torch.Tensor:
    """The micro-batch's ``action_mask`` ``(b, R)`` (its loss mask over the response columns)."""
    return response_view(sequence_values(mb, "response_mask"), mb)[0]


def _window_facts(loss_utils: Any, micro: list[TensorDict], group: Any, dp_size: int) -> dict:
    """``_optimizer_step_loss_norm`` of one window (every micro-batch of the rank's mini-batch), as plain numbers."""
    info = loss_utils._optimizer_step_loss_norm([_action_mask(mb) for mb in micro], group, dp_size, len(micro))
    return {"batch_num_tokens": float(info["batch_num_tokens"]), "global_batch_size": float(info["global_batch_size"]),
            "dp_size": int(info["dp_size"]), "accumulation_steps": len(micro)}


def _facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:
    """DP = 1 (one process, no process group): OpenRLHF's own window normaliser, its all-reduce skipped as it skips it
    without an initialised group."""
    loss_utils = importlib.import_module("openrlhf.utils.loss_utils")
    return [_window_facts(loss_utils, consecutive_cut([mini], plan)[0][0], None, len(minis)) for mini in minis]


def _value_loss(outputs: dict, mb: TensorDict, facts: dict) -> torch.Tensor:
    """PPOCritic.training_step's loss: ``ValueLoss(value_clip)`` on the critic's action values, the old values and the
    returns, with the window's facts."""
    loss_module = importlib.import_module("openrlhf.models.loss")
    values, real = response_view(outputs["values"], mb)
    width = values.shape[1]
    mask, old, returns = (response_view(sequence_values(mb, key), mb, width)[0]
                          for key in ("response_mask", "values", "returns"))
    loss = loss_module.ValueLoss(VALUE_CLIP)(values, old, returns, action_mask=(mask * real).to(values.dtype),
                                             dp_size=facts["dp_size"], batch_num_tokens=facts["batch_num_tokens"],
                                             global_batch_size=facts["global_batch_size"])
    return loss / facts["accumulation_steps"]  # DeepSpeed's engine.backward: loss / gradient_accumulation_steps


def _loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    if setting.loss == "value":
        return _value_loss(outputs, mb, facts)
    loss_module = importlib.import_module("openrlhf.models.loss")
    log_probs, mask, old, advantages = policy_columns(outputs, mb)
    policy = loss_module.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, token_level_loss=setting.mode == "token",
                                    policy_loss_type=setting.loss)
    loss = policy(log_probs, old, advantages, action_mask=mask,
                  dp_size=facts["dp_size"], batch_num_tokens=facts["batch_num_tokens"],
                  global_batch_size=facts["global_batch_size"])[0]
    return loss / facts["accumulation_steps"]  # DeepSpeed's engine.backward: loss / gradient_accumulation_steps


def _forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                      processor) -> dict:  # noqa: ARG001 - OpenRLHF's actor takes no top-K processor
    """One rank's step: the consecutive cut, ``iter_grad_accum_global_norm`` over it (its all-reduce over the world:
    a strategy without ``ds_device_mesh``), each micro-batch through ``Actor.forward`` and the model, the loss
    backpropagated; the outputs concatenated (the order is kept)."""
    loss_utils = importlib.import_module("openrlhf.utils.loss_utils")
    micro = consecutive_cut([mini], plan)[0][0]
    strategy = _Strategy()
    output_lst = []
    for mb, info in loss_utils.iter_grad_accum_global_norm(iter(micro), strategy, len(micro), _action_mask):
        mb = mb.copy()
        for key, value in {"batch_num_tokens": float(info["batch_num_tokens"]),
                           "global_batch_size": float(info["global_batch_size"]), "dp_size": int(info["dp_size"]),
                           "accumulation_steps": len(micro)}.items():
            mb.set_non_tensor(key, value)
        inputs, output_args = obj.prepare_model_inputs(mb)
        model_output = obj.prepare_model_outputs(model(**inputs), output_args, mb, None)
        loss = loss_function(model_output, mb)
        loss.backward()
        output_lst.append({"model_output": {k: v.detach() for k, v in model_output.items()}})
    return concatenated(output_lst, None, mini)


class _Strategy:
    """What ``iter_grad_accum_global_norm`` reads of OpenRLHF's DeepSpeed strategy: no device mesh (the DP group is
    the default group, the world of ``dp`` ranks)."""

    ds_device_mesh = None


@lru_cache(maxsize=1)
def openrlhf_step_layer() -> StepLayer | None:
    """OpenRLHF's PPO actor step, its modules imported after the adapter's (library.py: the stubs); None where they
    do not import."""
    try:
        openrlhf_modules()
        for module in ("openrlhf.models.loss", "openrlhf.utils.loss_utils"):
            importlib.import_module(module)
    except ImportError:
        return None
    return StepLayer("openrlhf", cuts=(Cut.COUNT,), facts=FACTS, losses=OPENRLHF_LOSSES,
                     functions={"cut": consecutive_cut, "facts": _facts, "loss": _loss, "restore": concatenated,
                                "forward_backward": _forward_backward},
                     dp_sizes=(1, 2), equal_micro_batches=True, world_is_dp=True,
                     restated={"cut": "the replay buffer's DataLoader (shuffle off), consecutive chunks of "
                                      "micro_train_batch_size (kit.step.consecutive_cut): OpenRLHF's own iterates "
                                      "its Experience items",
                               "restore": "the order is kept, the outputs concatenated (kit.step.concatenated)"})

