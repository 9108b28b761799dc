"""Invariants on the response slice helpers: no_padding_2_padding and the nested variants."""

from __future__ import annotations

import torch

from ..protocol.engine import action_view, completion_view, response_view
from ..truth.rules import offsets, response_positions
from .core import Ctx, add_facts, close, fail, invariant

NP2P = ("no_padding_2_padding",)


def _no_distillation_only(case):
    return case.with_(distillation_only=False)


@invariant("INV-SLICE-001", "no_padding_2_padding(log_probs) has shape (B, max_response_len)", contract=2,
           protects="the response slice has the trainer's (B, max_response_len) shape",
           needs=NP2P, adjust=_no_distillation_only)
def slice_shape(ctx: Ctx) -> None:
    sliced = ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
    want = (ctx.case.batch_size, ctx.case.response_width)
    if tuple(sliced.shape) != want:
        fail(f"no_padding_2_padding gave shape {tuple(sliced.shape)}, expected {want} "
             f"(responses {list(ctx.case.response_lens)}, max_response_len flag {ctx.case.max_response_len})")


@invariant("INV-SLICE-002", "sliced log_probs equal the oracle's log-prob of each response token, zero past r_i",
           contract=2,
           protects="the loss reads the right log-prob for each response token, zero past the response", needs=NP2P, adjust=_no_distillation_only)
def slice_values(ctx: Ctx) -> None:
    sliced = ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
    want, tol = ctx.expected.response_log_probs(ctx.case, *ctx.oracle("log_probs"))
    close(sliced, want, "response log_probs (B, max_response_len)", atol=tol)


def _poisoned_per_token(ctx: Ctx, trailing: tuple[int, ...] = ()):
    """A nested per-token tensor: finite where a response token is scored, NaN everywhere else."""
    case = ctx.case
    gen = torch.Generator().manual_seed(case.seed)
    values = torch.full((case.total_nnz, *trailing), float("nan"))
    starts = offsets(case.seq_lens)
    want = torch.zeros(case.batch_size, case.response_width, *trailing)
    for i, (start, stop) in enumerate(response_positions(case.prompt_lens, case.response_lens)):
        chunk = torch.randn(stop - start, *trailing, generator=gen)
        values[start:stop] = chunk
        want[i, : stop - start] = chunk
    nested = torch.nested.nested_tensor_from_jagged(values.to(ctx.device), starts.to(ctx.device))
    return nested, want


@invariant("INV-SLICE-003", "the slice reads exactly e_i - r_i - 1 .. e_i - 2 and pads with exact zeros "
           "(NaN elsewhere never leaks), also with trailing dims", contract=4,
           protects="the response slice reads only response positions (nothing else leaks), trailing dims too", modes=("any",), needs=NP2P)
def slice_reads_only_responses(ctx: Ctx) -> None:
    for trailing in ((), (3,)):
        nested, want = _poisoned_per_token(ctx, trailing)
        got = ctx.helper("no_padding_2_padding")(nested, ctx.batch)
        if tuple(got.shape) != tuple(want.shape):
            fail(f"no_padding_2_padding shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if not bool(torch.isfinite(got).all()):
            fail(f"no_padding_2_padding read a non-response position (NaN leaked): {got.tolist()}")
        if not torch.equal(got.cpu(), want):
            fail(f"no_padding_2_padding gave {got.tolist()}, expected {want.tolist()}")


@invariant("INV-SLICE-004", "response_from_nested gives the slice's rows without padding", contract=2,
           protects="response_from_nested gives each sample's response values",
           modes=("any",), needs=("response_from_nested",))
def response_from_nested_rows(ctx: Ctx) -> None:
    nested, want = _poisoned_per_token(ctx)
    got = ctx.helper("response_from_nested")(nested, ctx.batch["response_mask"])
    rows = [t.cpu() for t in got.unbind()]
    for i, r in enumerate(ctx.case.response_lens):
        if rows[i].shape != (r,) or not torch.equal(rows[i], want[i, :r]):
            fail(f"response_from_nested row {i} is {rows[i].tolist()}, expected {want[i, :r].tolist()}")


@invariant("INV-SLICE-005", "response_to_nested(padded responses) == response_from_nested(per-token) "
           "(round trip through the padded response shape)", contract=2,
           protects="padded responses convert back to the nested responses unchanged", modes=("any",),
           needs=("response_from_nested", "response_to_nested", "no_padding_2_padding"))
def response_round_trip(ctx: Ctx) -> None:
    nested, _ = _poisoned_per_token(ctx)
    mask = ctx.batch["response_mask"]
    padded = ctx.helper("no_padding_2_padding")(nested, ctx.batch)
    back = ctx.helper("response_to_nested")(padded, mask)
    direct = ctx.helper("response_from_nested")(nested, mask)
    if not (back.is_nested and torch.equal(back.offsets().cpu(), mask.offsets().cpu())):
        fail(f"response_to_nested returned shape {tuple(back.shape)}, expected nested over the responses")
    close(back.values(), direct.values(), "response_to_nested(no_padding_2_padding(x)) vs response_from_nested(x)",
          atol=0, rtol=0)


@invariant("INV-SLICE-006", "the response view every framework's consumer reads (verl's no_padding_2_padding slice, "
           "TRL's completion-only log-probs, OpenRLHF's action-mask slice: spec.protocol.response_view) of the "
           "engine's log_probs equals the oracle's log-prob of each response token", contract=2, facts=("key", "position"),
           protects="the (B, R) log-probs a PPO/GRPO loss reads, in the shape TRL's and OpenRLHF's losses take them",
           adjust=_no_distillation_only)
def consumer_response_view(ctx: Ctx) -> None:
    """Needs no helper of the engine's: the protocol's own view, for engines (TRL, OpenRLHF) that ship none. At the
    precision the engine declares for log_probs (:meth:`Ctx.oracle`), as INV-SLICE-002."""
    want, tol = ctx.expected.response_log_probs(ctx.case, *ctx.oracle("log_probs"))
    log_probs = ctx.run.outputs["log_probs"]
    if not log_probs.is_nested and (log_probs.dim() < 1 or log_probs.shape[0] != ctx.case.total_nnz):
        fail(f"response_view: 'log_probs' of shape {tuple(log_probs.shape)} is neither nested over the sequences nor "
             f"a packed ({ctx.case.total_nnz},) row: no view of it is the consumer's")
    for name, view in (("response_view", response_view), ("completion_view", completion_view),
                       ("action_view", action_view)):
        got, mask = view(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
        lens = torch.tensor(ctx.case.response_lens)
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(mask.cpu(), torch.arange(want.shape[1]) < lens[:, None]):
            fail(f"{name}: shape {tuple(got.shape)} with mask {mask.tolist()}, expected {tuple(want.shape)} with "
                 f"{list(ctx.case.response_lens)} real columns", key="log_probs")
        for i in range(want.shape[0]):  # per sequence, as every value mismatch is worded
            try:
                close(got[i], want[i], f"'log_probs' of sequence {i} in {name} (row {i} of (B, R))", atol=tol[i])
            except AssertionError as exc:  # the facts a record reads: column j of row i scores token p_i + j
                index = getattr(exc, "facts", {}).get("index")
                add_facts(exc, key="log_probs", sequence=i,
                          **({"position": ctx.case.prompt_lens[i] - 1 + index[0]} if index else {}))
                raise
