"""Planted bugs in impl's training step (spec/engines/impl/step.py): the mistakes of this year's step bugs (a loss
normalised per micro-batch, verl #6957 and NeMo-RL #3791; a global fact taken from one rank; a scale from the
micro-batch's padded width, verl's seq-mean-token-sum-norm default; a padding micro-batch missing a key, SkyRL #1815;
a restore applied after the micro-batches' losses were reordered), each rejected under ``ci`` by the ``INV-STEP-*``
invariant ``spec/planted/__init__.py`` names.

Each is a function ``layer -> layer`` that wraps one of impl's step functions (impl itself is not changed).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ..cases.step import select_rows
from ..protocol.step import CutPlan, LossSetting, StepLayer

__all__ = ["loss_normalized_per_micro_batch", "token_count_from_one_rank", "scale_from_padded_width",
           "padding_micro_batch_missing_key", "restore_after_losses_reordered"]


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


def token_count_from_one_rank(layer: StepLayer) -> StepLayer:
    """``batch_num_tokens`` is rank 0's own count, broadcast to every rank, not the sum over the ranks (a broadcast
    where an all-reduce belongs): a token mean over data-parallel ranks divides by too few tokens."""
    facts_of = layer.get("facts")

    def facts(minis: list[TensorDict], plan: CutPlan) -> list[dict]:
        every = facts_of(minis, plan)
        first = int(minis[0].get("response_mask").values().sum())
        return [{**f, "batch_num_tokens": first} for f in every]

    return layer.with_functions("planted", facts=facts)


def scale_from_padded_width(layer: StepLayer) -> StepLayer:
    """seq-mean-token-sum-norm without a loss_scale_factor divides by the micro-batch's padded width
    (``loss_mask.shape[-1]``, verl 0.9.1's default) instead of the mini-batch's longest response."""
    loss = layer.get("loss")

    def width_loss(outputs, mb: TensorDict, facts: dict, setting: LossSetting):
        return loss(outputs, mb, {**facts, "response_width": None}, setting)

    return layer.with_functions("planted", loss=width_loss)


def padding_micro_batch_missing_key(layer: StepLayer) -> StepLayer:
    """Ranks that need fewer micro-batches than the most any rank needs get padding micro-batches (a copy of their
    first sample with a zero loss mask, holding no sample of the step) built from the preparation's keys only: the
    step keys (old log-probs, advantages, old values, returns) are missing (SkyRL #1815)."""
    cut = layer.get("cut")

    def padded_cut(minis: list[TensorDict], plan: CutPlan) -> list:
        alone = [cut([m], plan)[0] for m in minis]
        count = max(len(list(micro)) for micro, _ in alone)
        out = []
        for mini, (micro, indices) in zip(minis, alone):
            micro = list(micro)
            missing = count - len(micro)
            if missing:
                pad = select_rows(mini, [0])
                for key in ("old_log_probs", "advantages", "values", "returns"):
                    del pad[key]
                mask = pad.get("response_mask")
                pad.set("response_mask", torch.nested.nested_tensor_from_jagged(torch.zeros_like(mask.values()),
                                                                                mask.offsets()))
                micro += [pad] * missing
                indices = None if indices is None else [*indices, *([[]] * missing)]
            out.append((micro, indices))
        return out

    return layer.with_functions("planted", cut=padded_cut)


def restore_after_losses_reordered(layer: StepLayer) -> StepLayer:
    """The micro-batches' results are sorted by their loss (largest first, to log the worst micro-batches) before the
    outputs are restored with the cut's indices, which name the micro-batches in their original order: samples get
    other samples' outputs whenever the sort moved a micro-batch."""
    restore = layer.get("restore")

    def sorted_restore(output_lst: list[dict], indices, mini: TensorDict) -> dict:
        ranked = sorted(output_lst, key=lambda out: -float(out.get("loss", 0.0)))
        return restore(ranked, indices, mini)

    return layer.with_functions("planted", restore=sorted_restore)
