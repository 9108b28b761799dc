"""Planted bugs in impl's training step (spec/engines/impl/step.py): the mistakes of this year's step bugs (a loss
normalised per micro-batch, verl #6957 and NeMo-RL #3791; a global fact taken from one rank; a DP size read off
another group than the DP group; a scale from the micro-batch's padded width, verl's seq-mean-token-sum-norm default;
a padding micro-batch missing a key, SkyRL #1815; a restore applied after the micro-batches' losses were reordered),
each rejected under ``ci`` by the ``INV-STEP-*`` invariant ``spec/planted/__init__.py`` names.

Each is a function ``layer -> layer`` that wraps one of impl's step functions (impl itself is not changed). The three
of the step's collectives (a token count from one rank, the DP size from the world, padding micro-batches) live inside
the framework's own step function, ``forward_backward`` (``impl.step.forward_backward_batch`` on real ranks), where
the suite restates no fact: they show only because the step runs there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

import impl
import impl.step

from ..cases.step import select_rows
from ..protocol.step import STEP_KEYS, CutPlan, LossSetting, StepLayer
from ..engines.kit.step import with_plan

__all__ = ["loss_normalized_per_micro_batch", "token_count_from_one_rank", "dp_size_from_world",
           "scale_from_padded_width", "padding_micro_batch_missing_key", "restore_after_losses_reordered"]


def _own_facts(mb: TensorDict, facts: dict) -> dict:
    mask = mb.get("response_mask")
    return {**facts, "batch_num_tokens": int(mask.values().sum()), "global_batch_size": int(mb.batch_size[0]),
            "response_width": int(mask.offsets().diff().max())}


def loss_normalized_per_micro_batch(layer: StepLayer) -> StepLayer:
    """Each micro-batch's loss is normalised by its own tokens, samples and width instead of the mini-batch's (the
    critic's value loss of verl #6957): the gradient grows with the micro-batch count."""
    loss = layer.get("loss")

    def local_loss(outputs, mb: TensorDict, facts: dict, setting: LossSetting):
        return loss(outputs, mb, _own_facts(mb, facts), setting)

    return layer.with_functions("planted", loss=local_loss)


def _handing(layer: StepLayer, fact: str, value_of) -> StepLayer:
    """``layer`` whose own step function hands every micro-batch ``fact = value_of(mini, group)`` (computed once per
    rank, before the cut) instead of what it computed."""
    step = layer.get("forward_backward")

    def forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                         processor):
        value = value_of(mini, group)

        def handed(model_output, micro_batch: TensorDict):
            micro_batch = micro_batch.copy()
            micro_batch.set_non_tensor(fact, value)
            return loss_function(model_output, micro_batch)

        return step(obj, model, mini, plan, setting, group, handed, processor)

    return layer.with_functions("planted", forward_backward=forward_backward)


def token_count_from_one_rank(layer: StepLayer) -> StepLayer:
    """Inside the step function, ``batch_num_tokens`` is the first rank's own count broadcast over the DP group, not
    the sum over the ranks (a broadcast where an all-reduce belongs): a token mean over data-parallel ranks divides by
    too few tokens."""

    def first_ranks_tokens(mini: TensorDict, group) -> int:
        tokens = mini.get("response_mask").values().to(torch.bool).sum().to(torch.int64).reshape(1)
        dist.broadcast(tokens, src=dist.get_global_rank(group, 0), group=group)
        return int(tokens)

    return _handing(layer, "batch_num_tokens", first_ranks_tokens)


def dp_size_from_world(layer: StepLayer) -> StepLayer:
    """Inside the step function, ``dp_size`` is the size of the whole world (``torch.distributed.get_world_size()``,
    the default group), not of the DP group it was handed: right while the world is the DP group, twice too large
    when the DP group is half the world (sequence or tensor parallel peers), and so is every rank's gradient."""
    return _handing(layer, "dp_size", lambda mini, group: dist.get_world_size())


def scale_from_padded_width(layer: StepLayer) -> StepLayer:
    """seq-mean-token-sum-norm without a loss_scale_factor divides by the micro-batch's padded width
    (``loss_mask.shape[-1]``, verl 0.9.1's default) instead of the mini-batch's longest response."""
    loss = layer.get("loss")

    def width_loss(outputs, mb: TensorDict, facts: dict, setting: LossSetting):
        return loss(outputs, mb, {**facts, "response_width": None}, setting)

    return layer.with_functions("planted", loss=width_loss)


def padding_micro_batch_missing_key(layer: StepLayer) -> StepLayer:
    """Inside the step function, each rank cuts its share alone and ranks that need fewer micro-batches than the most
    any rank needs (all-reduced, MAX) get padding micro-batches (a copy of their first sample with a zero loss mask)
    built from the preparation's keys only: the step keys (old log-probs, advantages, old values, returns) are missing
    (SkyRL #1815)."""
    def padded_cut(data: TensorDict, group):
        micro, indices = impl.prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=False)
        micro = list(micro)
        count = torch.tensor([len(micro)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        missing = int(count) - len(micro)
        if missing:
            pad = select_rows(data, [0])
            for key in STEP_KEYS[1:]:
                del pad[key]
            mask = pad.get("response_mask")
            pad.set("response_mask", torch.nested.nested_tensor_from_jagged(torch.zeros_like(mask.values()),
                                                                            mask.offsets()))
            micro += [pad] * missing
            indices = None if indices is None else [*indices, *([[]] * missing)]
        return micro, indices

    def forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                         processor):
        return impl.step.forward_backward_batch(obj, model, with_plan(mini, plan), loss_function, dp_group=group,
                                                processor=processor, cut=padded_cut)["model_output"]

    return layer.with_functions("planted", forward_backward=forward_backward)


def _by_loss(output_lst: list[dict]) -> list[dict]:
    return sorted(output_lst, key=lambda out: -float(out.get("loss", 0.0)))


def restore_after_losses_reordered(layer: StepLayer) -> StepLayer:
    """The micro-batches' results are sorted by their loss (largest first, to log the worst micro-batches) before the
    outputs are restored with the cut's indices, which name the micro-batches in their original order: samples get
    other samples' outputs whenever the sort moved a micro-batch (in one process and inside the step function on
    real ranks alike)."""
    restore = layer.get("restore")

    def sorted_restore(output_lst: list[dict], indices, mini: TensorDict) -> dict:
        return restore(_by_loss(output_lst), indices, mini)

    def sorted_postprocess(output_lst: list[dict], indices, data: TensorDict) -> dict:
        return impl.postprocess_batch_func(output_lst=_by_loss(output_lst), indices=indices, data=data)

    def forward_backward(obj, model, mini: TensorDict, plan: CutPlan, setting: LossSetting, group, loss_function,
                         processor):
        return impl.step.forward_backward_batch(obj, model, with_plan(mini, plan), loss_function, dp_group=group,
                                                processor=processor, restore=sorted_postprocess)["model_output"]

    return layer.with_functions("planted", restore=sorted_restore, forward_backward=forward_backward)
