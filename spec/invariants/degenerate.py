"""Degenerate inputs real runs produce (docs/contract.md, "Degenerate lengths"): an aborted or fully truncated
rollout hands a sample with a zero-length response (``r_i = 0``: its sequence is its prompt alone) beside ordinary
ones. The engine either takes it (every sample's outputs as the oracle gives them, the aborted one's response slice
a row of zeros) or refuses the micro-batch with an exception naming the response or its length; never a silently
shifted slice. (A sample without media tokens among media samples is drawn by the media cases, spec/cases/media.py;
a prompt at the length limit by the dense cases' prompt width and the micro-batch layer's budget: clause 13.3.)
"""

from __future__ import annotations

import torch

from ..execute.attribution import ENGINE, describe, origin
from ..cases.structure import EngineCase
from .batch import two_or_more
from ..cases.materialize import select_rows
from ..execute.harness import execute
from .core import Ctx, fail, invariant, match_runs

#: words a clear refusal of an empty response names
_CLEAR = ("response", "empty", "length", "zero")


def aborted(case: EngineCase) -> EngineCase:
    """Two samples or more, the one at ``seed mod B`` with a zero-length response (an aborted rollout)."""
    case = two_or_more(case)
    i = int(case.seed) % case.batch_size
    return case.with_(response_lens=case.response_lens[:i] + (0,) + case.response_lens[i + 1:],
                      distillation_only=False)


@invariant("INV-EDGE-001", "a zero-length response (an aborted rollout) beside others: the other samples' outputs are "
           "those they get without it and its response slice is a row of zeros, or the engine refuses it naming the "
           "response",
           contract=2, adjust=aborted,
           protects="an aborted or fully truncated rollout never shifts another sample's log-probs or hands its own "
           "slice values (a KeyError-free, silent-free step)")
def zero_length_response(ctx: Ctx) -> None:
    try:
        run = ctx.run
    except Exception as exc:  # noqa: BLE001 - the engine's refusal is judged here, anything else re-raised
        if origin(exc) != ENGINE:
            raise
        if any(word in str(exc).lower() for word in _CLEAR):
            return  # refused with a clear error
        fail(f"the engine refused a zero-length response with {describe(exc)}, an error that names neither the "
             "response nor its length")
    # the others against the engine's own run of them alone (its deviations elsewhere cancel: the oracle's values are
    # INV-VAL-*'s and INV-SLICE-*'s)
    others = [i for i, r in enumerate(ctx.case.response_lens) if r > 0]
    alone = execute(ctx.engine, ctx.case.subset(others), ctx.device, micro_batch=select_rows(run.micro_batch, others))
    whole = {key: [value.unbind()[i] for i in others] if isinstance(value, torch.Tensor) and value.is_nested
             else value for key, value in run.outputs.items()}
    match_runs(ctx, alone.outputs, whole, "the others without the aborted sample vs beside it", rows=others)
    slice_ = ctx.engine.helper("no_padding_2_padding")
    if slice_ is None:
        return
    got = slice_(run.outputs["log_probs"], run.micro_batch)
    width = ctx.case.response_width
    if tuple(got.shape[:2]) != (ctx.case.batch_size, width):
        fail(f"no_padding_2_padding(log_probs) has shape {tuple(got.shape)}, expected ({ctx.case.batch_size}, {width})")
    for i, r in enumerate(ctx.case.response_lens):
        if r == 0 and bool((got[i].detach() != 0).any()):
            fail(f"the aborted sample {i}'s response row is {got[i].detach().tolist()}, expected {width} zeros "
                 "(it has no response token)", key="log_probs", sequence=i)
