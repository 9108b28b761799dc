"""Invariants on prepare_model_inputs: mask, dense and packed inputs, labels, tail padding."""

from __future__ import annotations

import torch

from ..cases.structure import TEMPERATURE_FLOOR
from ..protocol.engine import PaddedLayout
from ..protocol.profile import Convention, padded_layout_of, profile_of, tail_multiple_of
from ..truth import handoff_checks as checks
from ..truth.rules import distinct_temperatures, token_temperatures
from .core import VALUE_FACTS, Ctx, fail, invariant, match_oracle
from .reproduction import VALUES, Plan

PADDED = ("padded",)
PACKED = ("packed",)


def _values(ctx: Ctx, key: str) -> torch.Tensor:
    return ctx.inputs_run.micro_batch[key].values()


def _layout(ctx: Ctx) -> PaddedLayout:
    """The padded layout the engine declares for the case (its profile's, verl's right-padded full rows unless it
    says otherwise, or a drawn switch's: :func:`spec.protocol.profile.padded_layout_of`)."""
    return padded_layout_of(ctx.engine, ctx.case)


@invariant("INV-MASK-001", "padded attention mask row i marks exactly sample i's n_i tokens where the declared "
           "layout puts them (verl's: n_i leading ones; the full sequence, not the response-only loss mask)",
           contract=1, facts=("key",),
           protects="the model attends to every token of each full sequence (a response-only mask gives wrong log-probs, high KL: verl #6278)", modes=PADDED,
           repro=Plan(("mask",)))
def mask_values(ctx: Ctx) -> None:
    checks.padded_mask(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx), ctx.inputs_run.views[0].attention_mask)


@invariant("INV-MASK-002", "padded attention mask is 0/1 in an integer or bool dtype, or a 2-D 0.0/1.0 float mask, "
           "on the ids' device (int32 where the engine declares verl's INT32_ATTENTION_MASK convention)", contract=1, facts=("key",),
           protects="the model reads the mask as 0/1 keep-flags on the ids' device (a 4-D float mask, or any other "
           "float value, is an additive bias to a Hugging Face model)", modes=PADDED, repro=Plan(("mask_dtype",)))
def mask_dtype_device(ctx: Ctx) -> None:
    view = ctx.inputs_run.views[0]
    checks.mask_dtype_device(view.attention_mask, view.input_ids, ctx.device, ctx.promises(Convention.INT32_ATTENTION_MASK),
                             Convention.INT32_ATTENTION_MASK.value)


@invariant("INV-MASK-003", "padded attention mask is (B, L) with the declared layout's width (verl's: max_seq_len) "
           "and sums to total_nnz", contract=1,
           protects="the padded batch has one row per sample and exactly total_nnz attended tokens",
           modes=PADDED, repro=Plan(("mask_shape",)))
def mask_shape_sum(ctx: Ctx) -> None:
    checks.padded_mask_shape(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx),
                             ctx.inputs_run.views[0].attention_mask)


@invariant("INV-MASK-004", "build_attention_mask_from_nested gives the full lengths at any width, 0/1 in an "
           "integer or bool dtype (int32 under INT32_ATTENTION_MASK)",
           contract=1, facts=("key",),
           protects="a trainer building a mask with the helper attends to the full sequences at any width", modes=("any",), needs=("build_attention_mask_from_nested",),
           repro=Plan(("mask_helper",)))
def mask_helper(ctx: Ctx) -> None:
    checks.mask_helper(ctx.helper("build_attention_mask_from_nested"), ctx.batch["input_ids"], ctx.case.seq_lens,
                       ctx.promises(Convention.INT32_ATTENTION_MASK), Convention.INT32_ATTENTION_MASK.value)


def _padded_rows(ctx: Ctx, got: torch.Tensor, key: str, what: str) -> None:
    """Each row of a padded model input (``(B, L)`` or ``(C, B, L)``) holds that sample's values in order at the
    columns the declared layout puts them (verl's: from column 0)."""
    checks.padded_rows(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx),
                       ctx.inputs_run.micro_batch[key].unbind(), got, key, what)


def _padding_values(ctx: Ctx, got: torch.Tensor, fill: int, key: str) -> None:
    checks.padding_fill(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx), got, fill, key)


def _with_padding(case):
    """Unequal lengths, so the padded batch has padding columns to look at."""
    if len(set(case.seq_lens)) > 1:
        return case
    return case.with_(prompt_lens=case.prompt_lens + (case.prompt_lens[0] + 1,),
                      response_lens=case.response_lens + (case.response_lens[0],),
                      temperature=case.temperature if not isinstance(case.temperature, tuple)
                      else case.temperature + (case.temperature[0],))


@invariant("INV-INPUT-001", "padded input_ids hold each sequence's tokens in order, (B, max_seq_len)",
           contract=1,
           protects="the model reads each sample's own tokens, in order, one row per sample", modes=PADDED,
           repro=Plan(("padded_ids",)))
def padded_ids(ctx: Ctx) -> None:
    _padded_rows(ctx, ctx.inputs_run.views[0].input_ids.cpu(), "input_ids", "sequence")


@invariant("INV-INPUT-002", "padded input_ids hold pad_token_id after each sequence", contract=1,
           protects="verl fills the padded columns with pad_token_id; the mask hides them", modes=PADDED,
           layout=True, adjust=_with_padding, repro=Plan(("ids_fill",)))
def padded_ids_fill(ctx: Ctx) -> None:
    _padding_values(ctx, ctx.inputs_run.views[0].input_ids.cpu(), ctx.case.pad_token_id, "input_ids")


@invariant("INV-POS-001", "padded position_ids are (B, L) or (4, B, L) (mRoPE), each sample's positions kept",
           contract=1, facts=("key",),
           protects="the model reads each token's own position (and mRoPE axes in the (4, B, L) layout)", modes=PADDED,
           repro=Plan(("padded_positions",)))
def padded_positions(ctx: Ctx) -> None:
    """An engine whose profile declares that its model computes the positions (``model_computes_positions``: a RoPE
    model) may hand none; positions it hands are checked all the same."""
    positions = _handed_positions(ctx)
    if positions is not None:
        _padded_rows(ctx, positions.cpu(), "position_ids", "positions")


def _handed_positions(ctx: Ctx):
    """The ``position_ids`` the engine handed the model, or None where its profile declares the model computes them
    (a failure where it does not: the model would read positions nobody gave it)."""
    positions = ctx.inputs_run.views[0].position_ids
    if positions is None and not profile_of(ctx.engine).model_computes_positions:
        fail("the engine handed the model no position_ids, and its profile does not declare that the model computes "
             "them (EngineProfile(model_computes_positions=True): a RoPE model on a padded batch)", key="position_ids")
    return positions


@invariant("INV-POS-003", "padded position_ids hold 0 after each sequence", contract=1,
           protects="verl fills padded position columns with 0; the mask hides them", modes=PADDED,
           layout=True, convention=Convention.PADDING_POSITION_ZERO, adjust=_with_padding,
           repro=Plan(("positions_fill",)))
def padded_positions_fill(ctx: Ctx) -> None:
    positions = _handed_positions(ctx)
    if positions is None:
        ctx.not_exercised("the model computes the positions (EngineProfile.model_computes_positions)")
        return
    _padding_values(ctx, positions.cpu(), 0, "position_ids")


def _parts(ctx: Ctx, key: str) -> list:
    """Model input or hand-off ``key`` of every rank's view, in rank order."""
    return [getattr(view, key) for view in ctx.inputs_run.views]


@invariant("INV-POS-002", "packed inputs: ids (1, n), positions (1, n) or (4, 1, n), no mask; ranks' "
           "slices concatenate to the packed row", contract=5, facts=("key",),
           protects="the packed model input holds each sequence's tokens and positions, the ranks' slices joining to the row", modes=PACKED,
           repro=Plan(("packed_inputs",)))
def packed_inputs(ctx: Ctx) -> None:
    checks.packed_inputs(_parts(ctx, "attention_mask"), _parts(ctx, "input_ids"), _parts(ctx, "position_ids"),
                         ctx.case.mrope, _values(ctx, "input_ids"), _values(ctx, "position_ids"))


def _bucketed(case):
    """A static bucket that leaves tail padding (the packed length not already a multiple of it)."""
    bucket = case.pad_to_length or 8
    if case.total_nnz % bucket == 0:
        bucket += 1
    return _no_distillation(case.with_(pad_to_length=bucket))


def _no_distillation(case):
    """No top-K distillation: the contract refuses it with tail padding (a bucket's; the teacher tensors would not
    cover the tail), and the row's length does not depend on it."""
    return case.with_(distillation_keys=(), distillation_only=False)


def _tail_rule(ctx: Ctx) -> tuple:
    """The packed row's length rule: total_nnz, the bucket, sp and the engine's tail multiple on the case (its
    profile's, or a drawn switch's: :func:`spec.protocol.profile.tail_multiple_of`)."""
    case = ctx.case
    return case.total_nnz, case.pad_to_length, case.sp_size, tail_multiple_of(ctx.engine, case)


@invariant("INV-PAD-001", "packed tail padding: length rounded up to the bucket then to sp, pad_size reported, "
           "positions restart at 0 (the pad never joins the last sequence)", contract=7,
           protects="bucket/sequence-parallel padding has the right length and pad_size and never joins the last sequence", modes=PACKED,
           needs=("bucket",), adjust=_bucketed, repro=Plan(("tail",)))
def packed_tail(ctx: Ctx) -> None:
    checks.packed_tail(_parts(ctx, "input_ids"), _parts(ctx, "position_ids"), ctx.inputs_run.views[0].pad_size,
                       *_tail_rule(ctx), ctx.case.mrope)


@invariant("INV-PAD-002", "packed tail padding holds id 0 and temperature 1", contract=7,
           protects="verl's tail padding holds id 0 and temperature 1; no output reads it", modes=PACKED,
           needs=("bucket",), layout=True, adjust=_bucketed, repro=Plan(("tail_fill",)))
def packed_tail_fill(ctx: Ctx) -> None:
    total, bucket, sp, multiple = _tail_rule(ctx)
    checks.tail_fill(_parts(ctx, "input_ids"), _parts(ctx, "temperature"), total, bucket, sp, multiple)


@invariant("INV-PAD-003", "an engine's own tail rule (its profile's tail_multiple, or a switch of its configuration "
           "that sets one: SFT's pad_to_multiple_of) pads the packed row to that multiple", contract=7,
           protects="a packed row the engine pads to a multiple (for its kernels, or to split it evenly) has the length "
                    "its rule gives", modes=PACKED,
           needs=("tail_rule",), strategy_kwargs={"pin_tail_rule": True}, adjust=_no_distillation,
           repro=Plan(("tail_rule",)))
def packed_tail_rule(ctx: Ctx) -> None:
    total, bucket, sp, multiple = _tail_rule(ctx)
    if multiple is None:
        ctx.not_exercised("no tail rule applies to this case (its engine's switch that sets one is not drawn)")
        return
    checks.packed_tail_rule(_parts(ctx, "input_ids"), total, bucket, sp, multiple)


def _check_labels(ctx: Ctx, where: str) -> None:
    checks.next_token_labels(_parts(ctx, "labels"), _values(ctx, "input_ids"), ctx.case.seq_lens, where)


@invariant("INV-LABEL-001", "rolled labels hold the next token inside every sequence", contract=5,
           protects="each scored token's label is the next token of the same sequence (the log-prob of the sampled token)",
           repro=Plan(("labels",)))
def labels_next_token(ctx: Ctx) -> None:
    _check_labels(ctx, "inside a sequence")


@invariant("INV-LABEL-002", "with sequence parallelism no label is read across a shard edge (roll the "
           "global row, then slice)", contract=5,
           protects="under sequence parallelism no label comes from across a shard edge", modes=PACKED, needs=("sp",),
           adjust=lambda c: c.with_(sp_size=max(c.sp_size, 2), distillation_keys=(), distillation_only=False),
           repro=Plan(("shard_labels",)))
def labels_shard_edges(ctx: Ctx) -> None:
    _check_labels(ctx, f"sp={ctx.case.sp_size}: a shard edge")


@invariant("INV-TEMP-004", "the packed per-token temperature (verl's temperature_rmpad) repeats each sample's "
           "temperature over its tokens", contract=6,
           protects="each packed token is scaled by its own sample's temperature", modes=PACKED,
           needs=("temperature_handoff",), adjust=lambda c: distinct_temperatures(c),
           repro=Plan(("token_temperature",)))
def temperature_rmpad(ctx: Ctx) -> None:
    checks.per_token_temperature(_parts(ctx, "temperature"), token_temperatures(ctx.case))


def _fused(c):
    return c.with_(use_fused_kernels=True, temperature=c.temperatures()[0], distillation_keys=(),
                   distillation_only=False, calculate_sum_pi_squared=False)


@invariant("INV-FUSED-001", "fused kernels: one float temperature reaches the model; "
           "packed shift_labels are the rolled ids (1, n)", contract=6,
           protects="fused kernels get one float temperature and the right shifted labels", needs=("fused",),
           adjust=_fused, repro=Plan(("fused_inputs",)))
def fused_inputs(ctx: Ctx) -> None:
    checks.fused_inputs(_parts(ctx, "model_temperature"), _parts(ctx, "model_labels"), _parts(ctx, "labels"),
                        ctx.case.temperatures()[0], ctx.case.use_remove_padding)


@invariant("INV-FUSED-002", "fused kernels: return_dict=True reaches the model", contract=6,
           protects="verl passes return_dict=True to a fused-kernel model", needs=("fused",),
           layout=True, adjust=_fused, repro=Plan(("return_dict",)))
def fused_return_dict(ctx: Ctx) -> None:
    checks.fused_return_dict(_parts(ctx, "return_dict"))


@invariant("INV-TEMP-005", "the padded hand-off (verl's output_args['temperature']) is each sample's "
           "temperature, (B,), or each token's, (total_nnz,)", contract=6,
           protects="the padded output step scales each sample by its own temperature",
           modes=PADDED, needs=("temperature_handoff",), adjust=lambda c: distinct_temperatures(c.with_(use_fused_kernels=False)),
           repro=Plan(("padded_temperature",)))
def padded_temperature(ctx: Ctx) -> None:
    checks.padded_temperature(ctx.inputs_run.views[0].temperature,
                              torch.tensor(ctx.case.temperatures(), dtype=torch.float32), token_temperatures(ctx.case))


_AT_CLAMP = (TEMPERATURE_FLOOR, 5e-9, 1e-10, 1e-12)


@invariant("INV-TEMP-006", "temperatures at or below 1e-8 are clamped to 1e-8: log_probs equal the oracle's",
           contract=6, facts=VALUE_FACTS,
           protects="a temperature at or below 1e-8 is clamped to 1e-8, never a division by ~0 (inf/NaN log-probs)", adjust=lambda c: c.with_(
               use_fused_kernels=False, distillation_only=False,
               temperature=tuple(_AT_CLAMP[(c.seed + i) % len(_AT_CLAMP)] for i in range(c.batch_size))), repro=VALUES)
def temperature_clamp(ctx: Ctx) -> None:
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"], f"at T={list(ctx.case.temperatures())}")


@invariant("INV-LABEL-003", "the rolled labels are the whole packed row rolled left by one (the wrap at "
           "each sequence end included), padded after the roll with 0", contract=5,
           protects="verl's exact rolled row: the wrap at each sequence end, which no response slice reads", modes=PACKED,
           needs=("bucket",), layout=True, adjust=_bucketed, repro=Plan(("rolled_row",)))
def labels_whole_row(ctx: Ctx) -> None:  # layout: no response slice reads the wrap
    checks.rolled_row(_parts(ctx, "labels"), _values(ctx, "input_ids"))


def _with_tail(c):
    """cu_seqlens passed (the strategy's ``padding=True`` gives a tail, so the final boundary shows)."""
    return c.with_(pass_cu_seqlens=True)


@invariant("INV-CU-001", "with cu_seqlens passed: cu_seqlens = the input offsets (plus a final boundary "
           "when padding was appended), integers on the ids' device", contract=1,
           protects="flash-attention's cu_seqlens bound each sequence (plus the tail), as integers on the ids' device", modes=PACKED,
           needs=("cu_seqlens",), adjust=_with_tail, strategy_kwargs={"padding": True}, repro=Plan(("cu_seqlens",)))
def cu_seqlens(ctx: Ctx) -> None:
    checks.cu_seqlens(_parts(ctx, "cu_seqlens"), _parts(ctx, "input_ids"), ctx.case.seq_lens)


@invariant("INV-CU-002", "with cu_seqlens passed: a CPU copy cu_seqlens_cpu equal to cu_seqlens", contract=1,
           protects="verl also passes a CPU copy of cu_seqlens",
           modes=PACKED, needs=("cu_seqlens",), layout=True, convention=Convention.CU_SEQLENS_HOST_COPY,
           adjust=_with_tail, strategy_kwargs={"padding": True}, repro=Plan(("cu_seqlens_cpu",)))
def cu_seqlens_cpu(ctx: Ctx) -> None:
    checks.cu_seqlens_host(_parts(ctx, "cu_seqlens_host"), _parts(ctx, "input_ids"), ctx.case.seq_lens)
