"""Invariants on the dense batches verl's helpers accept beyond the trainer's layout (issue 15).

The chosen behaviour (docs/verl-differences.md): ``left_right_2_no_padding`` compacts the
tokens ``attention_mask`` marks wherever they sit, takes each row's response from a nested
``responses`` when the batch carries one, and never turns a ``response_mask`` mark on a
padding column into a response token. An engine may instead refuse an inconsistent mask with
a ``ValueError`` naming ``response_mask``; it may not return anything else.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..cases.dropin import dropin_cases, from_engine_case, materialize_dropin
from .core import CATALOGUE, Ctx, InvariantInfo, fail

NEEDS = ("left_right_2_no_padding", "no_padding_2_padding")


@dataclass(frozen=True)
class DropinInfo(InvariantInfo):
    """An invariant drawn from :func:`spec.cases.dropin.dropin_cases` (``strategy_kwargs``)."""

    def cases(self, mode, engine):  # noqa: ARG002 - the layout, not the mode, picks the cases
        return dropin_cases(**self.strategy_kwargs)


def dropin_invariant(id: str, title: str, *, contract: int, layout: str, protects: str):
    def register(check):
        if id in CATALOGUE:
            raise ValueError(f"duplicate invariant id {id}")
        CATALOGUE[id] = DropinInfo(
            id=id, title=title, contract=contract, check=check, modes=("any",), needs=NEEDS, kind="dropin",
            strategy_kwargs={"layout": layout}, adjust=lambda case: from_engine_case(case, layout), protects=protects)
        return check
    return register


def _convert(ctx: Ctx):
    dense = materialize_dropin(ctx.case, ctx.device)
    before = {k: dense.get(k) for k in dense.keys()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # impl warns on these layouts by design
        out = ctx.helper("left_right_2_no_padding")(dense)
    return before, out


def _check_compacted(before: dict, out) -> None:
    mask = before["attention_mask"].bool()
    for key in ("input_ids", "position_ids"):
        value = out[key]
        if not value.is_nested:
            fail(f"{key} is not nested: shape {tuple(value.shape)}")
        got = [t.cpu().tolist() for t in value.unbind()]
        want = [row[m].cpu().tolist() for row, m in zip(before[key], mask)]
        if got != want:
            fail(f"nested {key} {got}, expected the tokens attention_mask marks {want}")


def _check_round_trip(ctx: Ctx, out, responses: list[list[int]], width: int) -> None:
    ids = out["input_ids"]
    scored = torch.nested.nested_tensor_from_jagged(torch.roll(ids.values(), -1), ids.offsets())
    sliced = ctx.helper("no_padding_2_padding")(scored, out).cpu()
    want = torch.tensor([row + [0] * (width - len(row)) for row in responses], dtype=sliced.dtype)
    if tuple(sliced.shape) != tuple(want.shape) or not torch.equal(sliced, want):
        fail(f"sliced responses {sliced.tolist()}, expected {want.tolist()}")


@dropin_invariant(
    "INV-DROPIN-001", "left_right_2_no_padding on right-padded whole sequences (split given as nested "
    "prompts/responses): tokens compacted by attention_mask, responses slice back", contract=10,
    layout="right_padded",
    protects="a batch not laid out left-right still yields the right tokens and response log-probs")
def right_padded_whole_sequences(ctx: Ctx) -> None:
    before, out = _convert(ctx)
    _check_compacted(before, out)
    responses = [t.cpu().tolist() for t in before["responses"].unbind()]
    _check_round_trip(ctx, out, responses, ctx.case.response_width)


@dropin_invariant(
    "INV-DROPIN-002", "left_right_2_no_padding with response_mask marks on padding columns: a ValueError "
    "naming response_mask, or the marks stay off the response tokens", contract=10, layout="stray_marks",
    protects="loss-mask marks on padding never make a padding position count as a response token")
def stray_response_mask_marks(ctx: Ctx) -> None:
    dense = materialize_dropin(ctx.case, ctx.device)
    before = {k: dense.get(k) for k in dense.keys()}  # verl's helper rewrites its argument's keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = ctx.helper("left_right_2_no_padding")(dense)
        except ValueError as exc:
            if "response_mask" not in str(exc):
                fail(f"refused with a ValueError that does not name 'response_mask': {exc}")
            return
    _check_compacted(before, out)
    lens = ctx.case.response_lens
    want = [row[:r].cpu().tolist() for row, r in zip(before["response_mask"], lens)]
    loss = out["loss_mask"]
    if loss.is_nested:
        got = [t.cpu().tolist() for t in loss.unbind()]
    else:  # a dense (B, R) loss mask: its response-token columns
        got = [row[:r].cpu().tolist() for row, r in zip(loss, lens)]
    if [[int(v) for v in row] for row in got] != [[int(v) for v in row] for row in want]:
        fail(f"loss_mask over the response tokens {got}, expected {want} (response lengths {list(lens)}, "
             f"response_mask {before['response_mask'].tolist()})")
    width = ctx.case.response_width
    responses = [row[:r].cpu().tolist() for row, r in zip(before["input_ids"][:, -width:], lens)]
    _check_round_trip(ctx, out, responses, width)
