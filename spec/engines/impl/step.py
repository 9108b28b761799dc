"""impl's training step as a step layer (spec/protocol/step.py): the reference the step invariants are shown on.

The cut is impl's micro-batch layer (``impl.prepare_micro_batches``: a token budget, balanced, or a sample count),
every rank cut to the count the ranks agree on (the most any rank needs: what ``same_micro_num_in_dp`` all-reduces);
the global facts are ``impl.step.global_facts`` over every rank's ``local_facts`` (the in-process ranks' gather); the
loss is ``impl.step``'s policy, value or SFT loss on the engine's per-token outputs sliced to the responses
(``impl.no_padding_2_padding``) with the step keys padded alike; the restore is ``impl.postprocess_batch_func``.

On real ranks (DP > 1) the step is impl's own ``impl.step.forward_backward_batch`` with the DP group the suite hands
it (a subgroup of the rank pool): its facts gathered and its micro-batch count agreed over that group.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

import impl
import impl.step

from ...protocol.step import Cut, CutPlan, Fact, LossSetting, StepLayer
from ..kit.step import agg_loss_losses, cut_with, with_plan

__all__ = ["impl_step_layer", "in_process_facts", "impl_loss", "impl_restore", "impl_forward_backward"]


def in_process_facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:  # noqa: ARG001 - the cut changes no fact
    """``impl.step.global_facts`` on each rank, the ranks' ``local_facts`` gathered in this process."""
    every = torch.stack([impl.step.local_facts(m.get("response_mask")) for m in minis])
    return [impl.step.global_facts(impl.step.local_facts(m.get("response_mask")), lambda local: every)
            for m in minis]


def _padded(mb: TensorDict, key: str, width: int) -> torch.Tensor:
    return impl.step.padded_responses(mb.get(key), width)


def impl_loss(outputs: dict, mb: TensorDict, facts: dict, setting: LossSetting) -> torch.Tensor:
    """impl's loss of one micro-batch: the per-token outputs' response slice, the step keys padded alike."""
    per_token = impl.no_padding_2_padding(outputs["values" if setting.loss == "value" else "log_probs"], mb)
    width = per_token.shape[-1]
    mask = _padded(mb, "response_mask", width)
    kwargs = {"loss_agg_mode": setting.mode, "dp_size": facts["dp_size"], "batch_num_tokens": facts["batch_num_tokens"],
              "global_batch_size": facts["global_batch_size"], "loss_scale_factor": setting.horizon,
              "response_width": facts["response_width"]}
    if setting.loss == "value":
        return impl.step.value_loss(per_token, _padded(mb, "values", width), _padded(mb, "returns", width), mask,
                                    **kwargs)
    if setting.loss == "sft":
        return impl.step.sft_loss(per_token, mask, **kwargs)
    if setting.loss == "distillation":  # the processor's per-token forward KL, clamped at 0 (top-K can go negative)
        kl = impl.no_padding_2_padding(outputs["distillation_losses"], mb)
        return impl.step.agg_loss(kl.clamp_min(0.0), mask, **kwargs)
    return impl.step.policy_loss(per_token, _padded(mb, "old_log_probs", width), _padded(mb, "advantages", width),
                                 mask, **kwargs)


def impl_restore(output_lst: list[dict], indices, mini: TensorDict) -> dict:
    """The micro-batches' outputs back in the rank's sample order (``impl.postprocess_batch_func``)."""
    data = mini.copy()
    data.set_non_tensor("use_dynamic_bsz", indices is not None)
    return impl.postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)["model_output"]


def impl_forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                          processor) -> dict:  # noqa: ARG001 - impl's loss reads the setting through loss_function
    """One rank's step: ``impl.step.forward_backward_batch`` over ``mini`` with the plan's cut flags."""
    return impl.step.forward_backward_batch(obj, model, with_plan(mini, plan), loss_function, dp_group=group,
                                            processor=processor)["model_output"]


def impl_step_layer() -> StepLayer:
    return StepLayer("impl", cuts=(Cut.COUNT, Cut.TOKENS),
                     facts=(Fact.BATCH_NUM_TOKENS, Fact.DP_SIZE, Fact.GLOBAL_BATCH_SIZE, Fact.RESPONSE_WIDTH),
                     losses=agg_loss_losses(),
                     functions={"cut": cut_with(impl.prepare_micro_batches), "facts": in_process_facts,
                                "loss": impl_loss, "restore": impl_restore, "forward_backward": impl_forward_backward},
                     dp_sizes=(1, 2, 4))
