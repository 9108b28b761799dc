"""What every engine's training step shares (spec/protocol/step.py): the ``agg_loss`` family's aggregation modes
(verl 0.9.1's names) in the step protocol's neutral terms, and the cut of a verl-style ``prepare_micro_batches`` over
in-process data-parallel ranks.

verl's ``agg_loss`` (verl/trainer/ppo/core_algos.py) and impl's drop-in (impl/step.py) offer the same five modes;
each is one :class:`~spec.protocol.step.Aggregation` formula, normalised by the whole mini-batch (verl hands every
micro-batch ``batch_num_tokens``, ``global_batch_size`` and ``dp_size``). ``seq-mean-token-sum-norm`` divides by a
horizon, ``loss_scale_factor`` when given (drawn: 16), else the library's default (the oracle's: the mini-batch's
longest response). The losses declared over them: the actor's PPO loss and the critic's value loss (every mode),
SFT (token-mean: verl's ``sft_loss`` normalises by ``batch_num_tokens`` only).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDict

from ...cases.materialize import select_rows
from ...protocol.engine import response_view

from ...protocol.step import Aggregation, Cut, CutPlan, Divisor, LossDeclaration, PerToken, Weighting

__all__ = ["AGG_LOSS_MODES", "TOKEN_MEAN", "agg_loss_losses", "HORIZONS", "with_plan", "cut_with", "consecutive_cut",
           "concatenated", "sequence_values", "policy_columns"]

TOKEN_MEAN = Aggregation("token-mean", Weighting.TOKEN, (Divisor.TOKENS,))
AGG_LOSS_MODES = (
    TOKEN_MEAN,
    Aggregation("token-sum", Weighting.TOKEN, ()),
    Aggregation("seq-mean-token-sum", Weighting.TOKEN, (Divisor.SEQUENCES,)),
    Aggregation("seq-mean-token-mean", Weighting.SEQUENCE_MEAN, (Divisor.SEQUENCES,)),
    Aggregation("seq-mean-token-sum-norm", Weighting.TOKEN, (Divisor.SEQUENCES, Divisor.HORIZON)),
)
#: the horizons drawn for seq-mean-token-sum-norm: the library's default (None) and a constant loss_scale_factor
HORIZONS = (None, 16)


def agg_loss_losses() -> tuple[LossDeclaration, ...]:
    """The actor's policy loss, the critic's value loss and the top-K forward-KL distillation loss in every mode, and
    SFT's token mean."""
    return (LossDeclaration("policy", PerToken.RATIO, AGG_LOSS_MODES, horizons=HORIZONS),
            LossDeclaration("value", PerToken.VALUE, AGG_LOSS_MODES, head="value", horizons=HORIZONS),
            LossDeclaration("distillation", PerToken.TOPK_FORWARD_KL, AGG_LOSS_MODES, horizons=HORIZONS, topk=2),
            LossDeclaration("sft", PerToken.NLL, (TOKEN_MEAN,),
                            undrawn={m.name: "SFT's loss normalises by batch_num_tokens only (a token mean)"
                                     for m in AGG_LOSS_MODES[1:]}))


def with_plan(mini: TensorDict, plan: CutPlan) -> TensorDict:
    """A shallow copy of one rank's mini-batch with the settings ``prepare_micro_batches`` reads for ``plan`` (the
    other path's setting, which it does not read, left as the mini-batch has it)."""
    td = mini.copy()
    path = {"max_token_len_per_gpu": plan.max_token_len} if plan.cut is Cut.TOKENS else \
        {"micro_batch_size_per_gpu": plan.micro_batch_size}
    for key, value in {"use_dynamic_bsz": plan.cut is Cut.TOKENS, **path}.items():
        td.set_non_tensor(key, value)
    for key in ("force_group_size", "sp_size"):  # one sample per group, no sequence parallelism, unless it says
        if key not in td.keys():
            td.set_non_tensor(key, 1)
    return td


def cut_with(prepare: Callable[..., Any]) -> Callable[[list[TensorDict], CutPlan], list]:
    """The cut of a ``prepare_micro_batches`` (verl's signature) over in-process ranks: every rank alone, then re-cut
    to the most micro-batches any rank needs (``min_num_micro_batch``), which is what ``same_micro_num_in_dp`` does
    over a DP group (an all-reduce of the counts, MAX)."""
    def cut(minis: list[TensorDict], plan: CutPlan) -> list:
        tds = [with_plan(m, plan) for m in minis]
        alone = [(list(micro), idx) for micro, idx in (prepare(td, same_micro_num_in_dp=False) for td in tds)]
        count = max(len(micro) for micro, _ in alone)
        out = []
        for td, (micro, idx) in zip(tds, alone):
            if len(micro) != count and plan.cut is Cut.TOKENS:
                micro, idx = prepare(td, same_micro_num_in_dp=False, min_num_micro_batch=count)
            out.append((list(micro), idx))
        return out
    return cut

def consecutive_cut(minis: list[TensorDict], plan: CutPlan) -> list:
    """Each rank's share in consecutive chunks of ``plan.micro_batch_size`` samples, in order (TRL's
    ``split_tensor_dict``, SkyRL's ``BatchIterator``): no indices, the order kept."""
    out = []
    for mini in minis:
        size = int(mini.batch_size[0])
        out.append(([select_rows(mini, list(range(a, min(a + plan.micro_batch_size, size))))
                     for a in range(0, size, plan.micro_batch_size)], None))
    return out


def concatenated(output_lst: list[dict], indices, mini: TensorDict) -> dict:  # noqa: ARG001 - the order is kept
    """The micro-batches' nested outputs joined in micro-batch order (a cut that keeps the order needs no restore)."""
    out = {}
    for key in output_lst[0]["model_output"]:
        parts = [o["model_output"][key] for o in output_lst]
        lengths = torch.cat([p.offsets().diff() for p in parts])
        offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        out[key] = torch.nested.nested_tensor_from_jagged(torch.cat([p.values() for p in parts]), offsets)
    return out


def sequence_values(mb: TensorDict, key: str) -> torch.Tensor:
    """A step key (nested over each response) placed over the full sequences at the positions that score the response
    tokens, so that :func:`response_view` reads it back as the completion columns, as it reads the log-probs."""
    ids, value = mb.get("input_ids"), mb.get(key)
    lengths, responses = ids.offsets().diff(), value.offsets().diff()
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), responses)
    cols = torch.arange(int(responses.sum())) - value.offsets()[:-1][rows]
    values = torch.zeros(int(lengths.sum()), dtype=value.values().dtype)
    values[(ids.offsets()[1:] - responses - 1)[rows] + cols] = value.values()
    return torch.nested.nested_tensor_from_jagged(values, ids.offsets())


def policy_columns(outputs: dict, mb: TensorDict) -> tuple[torch.Tensor, ...]:
    """A policy loss's ``(B, R)`` inputs over the response columns, as a consumer reads them (:func:`response_view`):
    the engine's log-probs, the loss mask (zero past each response), the old log-probs and the advantages."""
    log_probs, real = response_view(outputs["log_probs"], mb)
    width = log_probs.shape[1]
    mask, old, advantages = (response_view(sequence_values(mb, key), mb, width)[0]
                             for key in ("response_mask", "old_log_probs", "advantages"))
    return log_probs, (mask * real).to(log_probs.dtype), old, advantages
