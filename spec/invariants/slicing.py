"""Invariants on the response slice helpers: no_padding_2_padding and the nested variants (their checks stated once in
spec/truth/slice_checks.py, which a standalone reproducer runs too)."""

from __future__ import annotations

from ..protocol.engine import action_view, completion_view, response_view
from ..truth import slice_checks as checks
from .core import Ctx, invariant
from .reproduction import Plan

NP2P = ("no_padding_2_padding",)
#: every framework's consumer view of a per-token output (spec.protocol's)
VIEWS = (("response_view", response_view), ("completion_view", completion_view), ("action_view", action_view))


def _no_distillation_only(case):
    return case.with_(distillation_only=False)


@invariant("INV-SLICE-001", "no_padding_2_padding(log_probs) has shape (B, max_response_len)", contract=2,
           protects="the response slice has the trainer's (B, max_response_len) shape",
           needs=NP2P, adjust=_no_distillation_only, repro=Plan(("slice",)))
def slice_shape(ctx: Ctx) -> None:
    sliced = ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
    checks.slice_shape(sliced, ctx.case.batch_size, ctx.case.response_width, ctx.case.response_lens,
                       ctx.case.max_response_len)


@invariant("INV-SLICE-002", "sliced log_probs equal the oracle's log-prob of each response token, zero past r_i",
           contract=2,
           protects="the loss reads the right log-prob for each response token, zero past the response", needs=NP2P, adjust=_no_distillation_only,
           repro=Plan(("slice", "keys", "values")))
def slice_values(ctx: Ctx) -> None:
    sliced = ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
    checks.slice_values(sliced, *ctx.expected.response_log_probs(ctx.case, *ctx.oracle("log_probs")))


def _drawn(ctx: Ctx) -> dict:
    """What the per-token tensors of the helper checks are built from: the seed and the lengths."""
    case = ctx.case
    return {"seed": case.seed, "prompt_lens": case.prompt_lens, "response_lens": case.response_lens,
            "width": case.response_width, "device": ctx.device}


@invariant("INV-SLICE-003", "the slice reads exactly e_i - r_i - 1 .. e_i - 2 and pads with exact zeros "
           "(NaN elsewhere never leaks), also with trailing dims", contract=4,
           protects="the response slice reads only response positions (nothing else leaks), trailing dims too", modes=("any",), needs=NP2P,
           repro=Plan(("slice_reads",)))
def slice_reads_only_responses(ctx: Ctx) -> None:
    checks.slice_reads_only_responses(ctx.helper("no_padding_2_padding"), ctx.batch, **_drawn(ctx))


@invariant("INV-SLICE-004", "response_from_nested gives the slice's rows without padding", contract=2,
           protects="response_from_nested gives each sample's response values",
           modes=("any",), needs=("response_from_nested",), repro=Plan(("from_nested",)))
def response_from_nested_rows(ctx: Ctx) -> None:
    checks.response_from_nested_rows(ctx.helper("response_from_nested"), ctx.batch["response_mask"], **_drawn(ctx))


@invariant("INV-SLICE-005", "response_to_nested(padded responses) == response_from_nested(per-token) "
           "(round trip through the padded response shape)", contract=2,
           protects="padded responses convert back to the nested responses unchanged", modes=("any",),
           needs=("response_from_nested", "response_to_nested", "no_padding_2_padding"), repro=Plan(("round_trip",)))
def response_round_trip(ctx: Ctx) -> None:
    checks.response_round_trip(ctx.helper("no_padding_2_padding"), ctx.helper("response_to_nested"),
                               ctx.helper("response_from_nested"), ctx.batch, ctx.batch["response_mask"], **_drawn(ctx))


@invariant("INV-SLICE-006", "the response view every framework's consumer reads (verl's no_padding_2_padding slice, "
           "TRL's completion-only log-probs, OpenRLHF's action-mask slice: spec.protocol.response_view) of the "
           "engine's log_probs equals the oracle's log-prob of each response token", contract=2, facts=("key", "position"),
           protects="the (B, R) log-probs a PPO/GRPO loss reads, in the shape TRL's and OpenRLHF's losses take them",
           adjust=_no_distillation_only, repro=Plan(("keys", "response_values")))
def consumer_response_view(ctx: Ctx) -> None:
    """Needs no helper of the engine's: the protocol's own view, for engines (TRL, OpenRLHF) that ship none. At the
    precision the engine declares for log_probs (:meth:`Ctx.oracle`), as INV-SLICE-002."""
    want, tol = ctx.expected.response_log_probs(ctx.case, *ctx.oracle("log_probs"))
    checks.consumer_response_view(ctx.run.outputs["log_probs"], ctx.run.micro_batch, VIEWS, want, tol,
                                  ctx.case.response_lens, ctx.case.total_nnz, ctx.case.prompt_lens)
