"""Invariants on prepare_model_inputs: mask, dense and packed inputs, labels, tail padding."""

from __future__ import annotations

import torch

from ..cases.structure import TEMPERATURE_FLOOR
from ..protocol.engine import PaddedLayout
from ..protocol.profile import Convention, profile_of
from ..truth.rules import (distinct_temperatures, full_length_mask, layout_columns, layout_mask, layout_width, offsets,
                           padded_length, token_temperatures)
from .core import VALUE_FACTS, Ctx, fail, invariant, match_oracle

PADDED = ("padded",)
PACKED = ("packed",)


def _values(ctx: Ctx, key: str) -> torch.Tensor:
    return ctx.inputs_run.micro_batch[key].values()


def _lens(ctx: Ctx) -> torch.Tensor:
    return torch.tensor(ctx.case.seq_lens)


def _layout(ctx: Ctx) -> PaddedLayout:
    """The padded layout the engine's profile declares (verl's right-padded full rows unless it says otherwise)."""
    return profile_of(ctx.engine).padded_layout


def _layout_words(ctx: Ctx) -> str:
    return "" if _layout(ctx) is PaddedLayout.RIGHT else f" in the declared {_layout(ctx).value} layout"


@invariant("INV-MASK-001", "padded attention mask row i marks exactly sample i's n_i tokens where the declared "
           "layout puts them (verl's: n_i leading ones; the full sequence, not the response-only loss mask)",
           contract=1, facts=("key",),
           protects="the model attends to every token of each full sequence (a response-only mask gives wrong log-probs, high KL: verl #6278)", modes=PADDED)
def mask_values(ctx: Ctx) -> None:
    mask = ctx.inputs_run.views[0].attention_mask
    if mask is None:
        fail("padded mode returned attention_mask=None")
    lens = _lens(ctx)
    want = layout_mask(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx), mask.shape[-1])
    got = mask.detach().to("cpu", torch.int64)
    if got.shape != want.shape or not torch.equal(got, want):
        rows = [r for r in range(min(got.shape[0], want.shape[0])) if not torch.equal(got[r], want[r])]
        row = rows[0] if rows else 0
        fail(f"attention_mask row {row} is {got[row].tolist()}, expected {want[row].tolist()}{_layout_words(ctx)} "
             f"(sequence length {int(lens[row])}, response length {ctx.case.response_lens[row]})",
             key="attention_mask", sequence=row)


#: the dtypes a padded attention mask may have: 0/1 in an integer or bool dtype, or (a 2-D mask only) 0.0/1.0 in a
#: floating dtype: a Hugging Face model casts a 2-D mask to bool (``masking_utils``; before it,
#: ``_prepare_4d_attention_mask`` read 1.0 as keep), and only a 4-D mask is an additive bias
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _mask_dtype(ctx: Ctx, mask: torch.Tensor, what: str) -> None:
    """The contract: an integer or bool dtype, or a 2-D floating mask of 0.0/1.0 only (a model reads any other float
    value, or a float mask of another rank, as an additive bias); int32 only where the engine promises verl's
    convention."""
    if ctx.promises(Convention.INT32_ATTENTION_MASK):
        if mask.dtype != torch.int32:
            fail(f"{what} dtype is {mask.dtype}, expected torch.int32 (the engine's profile declares "
                 f"{Convention.INT32_ATTENTION_MASK.value})", key="attention_mask")
    elif mask.is_floating_point():
        if mask.dim() != 2:
            fail(f"{what} is a {mask.dim()}-D {mask.dtype} mask: a model adds a float mask of that rank to its "
                 "attention scores (an additive bias), so 1.0/0.0 keep-flags mask nothing; expected 0/1 in an "
                 f"integer or bool dtype, or a 2-D 0.0/1.0 mask", key="attention_mask")
        odd = mask[(mask != 0) & (mask != 1)]
        if odd.numel():
            fail(f"{what} ({mask.dtype}) holds {sorted(set(odd.detach().cpu().tolist()))[:4]}: a 2-D float mask is "
                 "read as 0/1 keep-flags (cast to bool), so only 0.0 and 1.0 mean what they say", key="attention_mask")
    elif mask.dtype not in MASK_DTYPES:
        fail(f"{what} dtype is {mask.dtype}, expected 0/1 in an integer or bool dtype "
             f"({', '.join(str(d) for d in MASK_DTYPES)}) or a 2-D 0.0/1.0 float mask", key="attention_mask")


@invariant("INV-MASK-002", "padded attention mask is 0/1 in an integer or bool dtype, or a 2-D 0.0/1.0 float mask, "
           "on the ids' device (int32 where the engine declares verl's INT32_ATTENTION_MASK convention)", contract=1, facts=("key",),
           protects="the model reads the mask as 0/1 keep-flags on the ids' device (a 4-D float mask, or any other "
           "float value, is an additive bias to a Hugging Face model)", modes=PADDED)
def mask_dtype_device(ctx: Ctx) -> None:
    view = ctx.inputs_run.views[0]
    mask, ids = view.attention_mask, view.input_ids
    if mask is None:
        fail("padded mode returned attention_mask=None")
    _mask_dtype(ctx, mask, "attention_mask")
    if mask.device != ids.device or mask.device.type != torch.device(ctx.device).type:
        fail(f"attention_mask on {mask.device}, input_ids on {ids.device}, batch on {ctx.device}")


@invariant("INV-MASK-003", "padded attention mask is (B, L) with the declared layout's width (verl's: max_seq_len) "
           "and sums to total_nnz", contract=1,
           protects="the padded batch has one row per sample and exactly total_nnz attended tokens",
           modes=PADDED)
def mask_shape_sum(ctx: Ctx) -> None:
    mask = ctx.inputs_run.views[0].attention_mask
    if mask is None:
        fail("padded mode returned attention_mask=None")
    want = (ctx.case.batch_size, layout_width(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx)))
    if tuple(mask.shape) != want:
        fail(f"attention_mask shape {tuple(mask.shape)}, expected {want}")
    if int(mask.sum()) != ctx.case.total_nnz:
        fail(f"attention_mask sums to {int(mask.sum())}, total_nnz is {ctx.case.total_nnz}")


@invariant("INV-MASK-004", "build_attention_mask_from_nested gives the full lengths at any width, 0/1 in an "
           "integer or bool dtype (int32 under INT32_ATTENTION_MASK)",
           contract=1, facts=("key",),
           protects="a trainer building a mask with the helper attends to the full sequences at any width", modes=("any",), needs=("build_attention_mask_from_nested",))
def mask_helper(ctx: Ctx) -> None:
    build = ctx.helper("build_attention_mask_from_nested")
    ids = ctx.batch["input_ids"]
    lens = _lens(ctx)
    for width in (None, max(ctx.case.seq_lens) + 2):
        mask = build(ids) if width is None else build(ids, max_seq_len=width)
        want = full_length_mask(ctx.case.seq_lens, width or max(lens), torch.int32)  # at the width asked for
        _mask_dtype(ctx, mask, f"build_attention_mask_from_nested(max_seq_len={width})")
        if tuple(mask.shape) != (len(lens), width or max(lens)) or not torch.equal(mask.cpu().to(torch.int32), want):
            fail(f"build_attention_mask_from_nested(max_seq_len={width}) gave {mask.tolist()} "
                 f"({mask.dtype}), expected {want.tolist()}")


def _padded_rows(ctx: Ctx, got: torch.Tensor, key: str, what: str) -> None:
    """Each row of a padded model input (``(B, L)`` or ``(C, B, L)``) holds that sample's values in order at the
    columns the declared layout puts them (verl's: from column 0)."""
    rows = [t.cpu() for t in ctx.inputs_run.micro_batch[key].unbind()]
    case = ctx.case
    width = layout_width(case.prompt_lens, case.response_lens, _layout(ctx))
    channels = (rows[0].shape[0],) if case.mrope and key == "position_ids" else ()
    want_shape = (*channels, len(rows), width)
    if tuple(got.shape) != want_shape:
        fail(f"padded {key} shape {tuple(got.shape)}, expected {want_shape}{_layout_words(ctx)}")
    columns = layout_columns(case.prompt_lens, case.response_lens, _layout(ctx))
    for i, (row, cols) in enumerate(zip(rows, columns)):
        have = got[..., i, cols]
        if not torch.equal(have, row.to(have.dtype)):
            fail(f"padded {key} row {i} holds {have.tolist()} at columns {cols.tolist()}, expected the {what} "
                 f"{row.tolist()}{_layout_words(ctx)}", key=key, sequence=i)


def _padding_values(ctx: Ctx, got: torch.Tensor, fill: int, key: str) -> None:
    pad = ~layout_mask(ctx.case.prompt_lens, ctx.case.response_lens, _layout(ctx), got.shape[-1]).bool()
    values = got[..., pad]
    if values.numel() and bool((values != fill).any()):
        fail(f"padded {key} hold {sorted(set(values.reshape(-1).tolist()))[:8]} in the padding, "
             f"verl fills {fill}")


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
           protects="the model reads each sample's own tokens, in order, one row per sample", modes=PADDED)
def padded_ids(ctx: Ctx) -> None:
    _padded_rows(ctx, ctx.inputs_run.views[0].input_ids.cpu(), "input_ids", "sequence")


@invariant("INV-INPUT-002", "padded input_ids hold pad_token_id after each sequence", contract=1,
           protects="verl fills the padded columns with pad_token_id; the mask hides them", modes=PADDED,
           layout=True, adjust=_with_padding)
def padded_ids_fill(ctx: Ctx) -> None:
    _padding_values(ctx, ctx.inputs_run.views[0].input_ids.cpu(), ctx.case.pad_token_id, "input_ids")


@invariant("INV-POS-001", "padded position_ids are (B, L) or (4, B, L) (mRoPE), each sample's positions kept",
           contract=1, facts=("key",),
           protects="the model reads each token's own position (and mRoPE axes in the (4, B, L) layout)", modes=PADDED)
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
           layout=True, convention=Convention.PADDING_POSITION_ZERO, adjust=_with_padding)
def padded_positions_fill(ctx: Ctx) -> None:
    positions = _handed_positions(ctx)
    if positions is None:
        ctx.not_exercised("the model computes the positions (EngineProfile.model_computes_positions)")
        return
    _padding_values(ctx, positions.cpu(), 0, "position_ids")


def _joined(ctx: Ctx, key: str, dim: int = -1) -> torch.Tensor:
    """Model input ``key`` (``input_ids``/``position_ids``) of every rank, joined along the tokens."""
    return torch.cat([getattr(view, key).cpu() for view in ctx.inputs_run.views], dim=dim)


@invariant("INV-POS-002", "packed inputs: ids (1, n), positions (1, n) or (4, 1, n), no mask; ranks' "
           "slices concatenate to the packed row", contract=5, facts=("key",),
           protects="the packed model input holds each sequence's tokens and positions, the ranks' slices joining to the row", modes=PACKED)
def packed_inputs(ctx: Ctx) -> None:
    total = ctx.case.total_nnz
    for r, view in enumerate(ctx.inputs_run.views):
        if view.attention_mask is not None:
            fail(f"rank {r}: packed attention_mask must be None")
        ids, pos = view.input_ids, view.position_ids
        if pos is None:
            fail(f"rank {r}: a packed row handed without position_ids: the model cannot find its sequences' "
                 "boundaries (they are where the positions restart at 0)", key="position_ids")
        if ids.dim() != 2 or ids.shape[0] != 1:
            fail(f"rank {r}: packed input_ids shape {tuple(ids.shape)}, expected (1, n)")
        want_pos = (4, 1, ids.shape[1]) if ctx.case.mrope else (1, ids.shape[1])
        if tuple(pos.shape) != want_pos:
            fail(f"rank {r}: packed position_ids shape {tuple(pos.shape)}, expected {want_pos}")
    ids = _joined(ctx, "input_ids")[0]
    pos = _joined(ctx, "position_ids")
    if ids.shape[0] < total or not torch.equal(ids[:total], _values(ctx, "input_ids").cpu()):
        fail(f"packed input_ids {ids.tolist()} do not start with the sequences' ids")
    want_pos = _values(ctx, "position_ids").cpu()
    got_pos = pos[..., 0, :total] if ctx.case.mrope else pos[0, :total]
    if not torch.equal(got_pos, want_pos):
        fail(f"packed position_ids {got_pos.tolist()}, expected {want_pos.tolist()}")


def _bucketed(case):
    """A static bucket that leaves tail padding (the packed length not already a multiple of it)."""
    bucket = case.pad_to_length or 8
    if case.total_nnz % bucket == 0:
        bucket += 1
    return case.with_(pad_to_length=bucket, distillation_keys=(), distillation_only=False)


def _tail(ctx: Ctx):
    case = ctx.case
    total = case.total_nnz
    padded = padded_length(total, case.pad_to_length, case.sp_size, profile_of(ctx.engine).tail_multiple)
    ids = _joined(ctx, "input_ids")[0]
    if ids.shape[0] != padded:
        fail(f"packed row has {ids.shape[0]} tokens, expected {padded} (total_nnz={total}, "
             f"bucket={case.pad_to_length}, sp={case.sp_size})")
    return ids, total, padded


@invariant("INV-PAD-001", "packed tail padding: length rounded up to the bucket then to sp, pad_size reported, "
           "positions restart at 0 (the pad never joins the last sequence)", contract=7,
           protects="bucket/sequence-parallel padding has the right length and pad_size and never joins the last sequence", modes=PACKED,
           needs=("bucket",), adjust=_bucketed)
def packed_tail(ctx: Ctx) -> None:
    ids, total, padded = _tail(ctx)
    pad = padded - total
    reported = ctx.inputs_run.views[0].pad_size
    if int(reported) != pad:
        fail(f"pad_size is {reported}, expected {pad}")
    if pad:
        pos = _joined(ctx, "position_ids")
        tail_pos = (pos[0, 0] if ctx.case.mrope else pos[0])[total:]
        if int(tail_pos[0]) != 0:
            fail(f"tail positions {tail_pos.tolist()[:8]} must restart at 0 (else the pad joins the last sequence)")


@invariant("INV-PAD-002", "packed tail padding holds id 0 and temperature 1", contract=7,
           protects="verl's tail padding holds id 0 and temperature 1; no output reads it", modes=PACKED,
           needs=("bucket",), layout=True, adjust=_bucketed)
def packed_tail_fill(ctx: Ctx) -> None:
    ids, total, _ = _tail(ctx)
    temps = _token_temperatures(ctx)[total:]
    if bool((ids[total:] != 0).any()):
        fail(f"tail ids {ids[total:].tolist()[:8]}, verl fills zeros")
    if not torch.equal(temps, torch.ones_like(temps)):
        fail(f"tail temperature {temps.tolist()[:8]}, verl fills ones")


def _token_temperatures(ctx: Ctx) -> torch.Tensor:
    """The per-token temperature every rank hands its output step, joined (packed)."""
    temps = [view.temperature for view in ctx.inputs_run.views]
    if any(not isinstance(t, torch.Tensor) for t in temps):
        fail(f"the packed hand-off carries temperature {temps[0]!r}, expected one per token")
    return torch.cat([t.reshape(-1).cpu() for t in temps])


def _rolled(ctx: Ctx) -> torch.Tensor:
    """The labels every rank's outputs score, joined (one per packed token)."""
    labels = [view.labels for view in ctx.inputs_run.views]
    if any(lab is None for lab in labels):
        fail("the engine hands no labels (the ids its log-probs score) to its output step")
    return torch.cat([lab.reshape(-1).cpu() for lab in labels])


def _check_labels(ctx: Ctx, where: str) -> None:
    labels = _rolled(ctx)
    ids = _values(ctx, "input_ids").cpu()
    if labels.shape[0] < ids.shape[0]:
        fail(f"the rolled labels have {labels.shape[0]} labels for {ids.shape[0]} tokens")
    ends = offsets(ctx.case.seq_lens)[1:] - 1
    inner = torch.ones(ids.shape[0], dtype=torch.bool)
    inner[ends] = False
    k = inner.nonzero().squeeze(1)
    bad = (labels[k] != ids[k + 1]).nonzero()
    if bad.numel():
        pos = int(k[bad[0, 0]])
        fail(f"label at packed position {pos} is {int(labels[pos])}, the next token is {int(ids[pos + 1])} "
             f"({where}; ids {ids.tolist()}, labels {labels[: ids.shape[0]].tolist()})")


@invariant("INV-LABEL-001", "rolled labels hold the next token inside every sequence", contract=5,
           protects="each scored token's label is the next token of the same sequence (the log-prob of the sampled token)")
def labels_next_token(ctx: Ctx) -> None:
    _check_labels(ctx, "inside a sequence")


@invariant("INV-LABEL-002", "with sequence parallelism no label is read across a shard edge (roll the "
           "global row, then slice)", contract=5,
           protects="under sequence parallelism no label comes from across a shard edge", modes=PACKED, needs=("sp",),
           adjust=lambda c: c.with_(sp_size=max(c.sp_size, 2), distillation_keys=(), distillation_only=False))
def labels_shard_edges(ctx: Ctx) -> None:
    _check_labels(ctx, f"sp={ctx.case.sp_size}: a shard edge")


@invariant("INV-TEMP-004", "the packed per-token temperature (verl's temperature_rmpad) repeats each sample's "
           "temperature over its tokens", contract=6,
           protects="each packed token is scaled by its own sample's temperature", modes=PACKED,
           needs=("temperature_handoff",), adjust=lambda c: distinct_temperatures(c))
def temperature_rmpad(ctx: Ctx) -> None:
    got = _token_temperatures(ctx)[: ctx.case.total_nnz]
    want = token_temperatures(ctx.case)
    if not torch.allclose(got.float(), want):
        fail(f"per-token temperature {got.tolist()}, expected {want.tolist()}")


def _fused(c):
    return c.with_(use_fused_kernels=True, temperature=c.temperatures()[0], distillation_keys=(),
                   distillation_only=False, calculate_sum_pi_squared=False)


@invariant("INV-FUSED-001", "fused kernels: one float temperature reaches the model; "
           "packed shift_labels are the rolled ids (1, n)", contract=6,
           protects="fused kernels get one float temperature and the right shifted labels", needs=("fused",),
           adjust=_fused)
def fused_inputs(ctx: Ctx) -> None:
    if ctx.case.use_remove_padding:
        _rolled(ctx)  # every rank hands its labels
    for r, view in enumerate(ctx.inputs_run.views):
        temp = view.model_temperature
        if isinstance(temp, torch.Tensor) or not isinstance(temp, (int, float)) \
                or abs(float(temp) - ctx.case.temperatures()[0]) > 1e-6:
            fail(f"rank {r}: the model is handed temperature {temp!r}, expected the float {ctx.case.temperature}")
        if ctx.case.use_remove_padding:
            labels, rolled = view.model_labels, view.labels.reshape(-1)
            if labels is None or tuple(labels.shape) != (1, rolled.shape[0]) \
                    or not torch.equal(labels[0].cpu(), rolled.cpu()):
                fail(f"rank {r}: the model's labels (shift_labels) {None if labels is None else labels.tolist()}, expected the "
                     f"rolled ids {rolled.tolist()} as (1, n)")


@invariant("INV-FUSED-002", "fused kernels: return_dict=True reaches the model", contract=6,
           protects="verl passes return_dict=True to a fused-kernel model", needs=("fused",),
           layout=True, adjust=_fused)
def fused_return_dict(ctx: Ctx) -> None:
    for r, view in enumerate(ctx.inputs_run.views):
        if view.return_dict is not True:
            fail(f"rank {r}: the model is handed return_dict={view.return_dict!r}, verl passes True")


@invariant("INV-TEMP-005", "the padded hand-off (verl's output_args['temperature']) is each sample's "
           "temperature, (B,), or each token's, (total_nnz,)", contract=6,
           protects="the padded output step scales each sample by its own temperature",
           modes=PADDED, needs=("temperature_handoff",), adjust=lambda c: distinct_temperatures(c.with_(use_fused_kernels=False)))
def padded_temperature(ctx: Ctx) -> None:
    got = ctx.inputs_run.views[0].temperature
    per_sample = torch.tensor(ctx.case.temperatures(), dtype=torch.float32)
    per_token = token_temperatures(ctx.case)
    if isinstance(got, torch.Tensor):
        flat = got.detach().cpu().float()
        for want in (per_sample, per_token):
            if tuple(flat.shape) == tuple(want.shape) and torch.allclose(flat, want, rtol=1e-6, atol=0):
                return
    fail(f"the padded hand-off carries temperature {got!r}, expected the per-sample {per_sample.tolist()} (or "
         "that per token)")


_AT_CLAMP = (TEMPERATURE_FLOOR, 5e-9, 1e-10, 1e-12)


@invariant("INV-TEMP-006", "temperatures at or below 1e-8 are clamped to 1e-8: log_probs equal the oracle's",
           contract=6, facts=VALUE_FACTS,
           protects="a temperature at or below 1e-8 is clamped to 1e-8, never a division by ~0 (inf/NaN log-probs)", adjust=lambda c: c.with_(
               use_fused_kernels=False, distillation_only=False,
               temperature=tuple(_AT_CLAMP[(c.seed + i) % len(_AT_CLAMP)] for i in range(c.batch_size))))
def temperature_clamp(ctx: Ctx) -> None:
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"], f"at T={list(ctx.case.temperatures())}")


@invariant("INV-LABEL-003", "the rolled labels are the whole packed row rolled left by one (the wrap at "
           "each sequence end included), padded after the roll with 0", contract=5,
           protects="verl's exact rolled row: the wrap at each sequence end, which no response slice reads", modes=PACKED,
           needs=("bucket",), layout=True, adjust=_bucketed)
def labels_whole_row(ctx: Ctx) -> None:  # layout: no response slice reads the wrap
    labels = _rolled(ctx)
    ids = _values(ctx, "input_ids").cpu()
    want = torch.roll(ids, -1)
    total = ids.shape[0]
    if labels.shape[0] < total or not torch.equal(labels[:total], want):
        fail(f"rolled labels {labels[:total].tolist()}, expected the packed row rolled by one "
             f"{want.tolist()} (the roll comes before any bucket or sequence-parallel padding)")
    if bool((labels[total:] != 0).any()):
        fail(f"labels of the tail padding are {labels[total:].tolist()}, expected zeros")


def _cu_want(ctx: Ctx) -> tuple[torch.Tensor, int]:
    case = ctx.case
    padded = _joined(ctx, "input_ids").shape[-1]
    want = offsets(case.seq_lens)
    return (want if padded == case.total_nnz else torch.cat([want, torch.tensor([padded])])), padded


def _with_tail(c):
    """cu_seqlens passed (the strategy's ``padding=True`` gives a tail, so the final boundary shows)."""
    return c.with_(pass_cu_seqlens=True)


@invariant("INV-CU-001", "with cu_seqlens passed: cu_seqlens = the input offsets (plus a final boundary "
           "when padding was appended), integers on the ids' device", contract=1,
           protects="flash-attention's cu_seqlens bound each sequence (plus the tail), as integers on the ids' device", modes=PACKED,
           needs=("cu_seqlens",), adjust=_with_tail, strategy_kwargs={"padding": True})
def cu_seqlens(ctx: Ctx) -> None:
    want, padded = _cu_want(ctx)
    for r, view in enumerate(ctx.inputs_run.views):
        cu, ids = view.cu_seqlens, view.input_ids
        if cu is None:
            fail(f"rank {r}: the model is handed no cu_seqlens")
        # The contract fixes no dtype (flash-attn wants int32, which impl gives; verl gives int64).
        if cu.dtype not in (torch.int32, torch.int64) or cu.device.type != ids.device.type:
            fail(f"rank {r}: cu_seqlens is {cu.dtype} on {cu.device}, expected integers on {ids.device}")
        if not torch.equal(cu.cpu().long(), want):
            fail(f"rank {r}: cu_seqlens {cu.tolist()}, expected {want.tolist()} for a packed row of {padded} tokens")


@invariant("INV-CU-002", "with cu_seqlens passed: a CPU copy cu_seqlens_cpu equal to cu_seqlens", contract=1,
           protects="verl also passes a CPU copy of cu_seqlens",
           modes=PACKED, needs=("cu_seqlens",), layout=True, convention=Convention.CU_SEQLENS_HOST_COPY,
           adjust=_with_tail, strategy_kwargs={"padding": True})
def cu_seqlens_cpu(ctx: Ctx) -> None:
    want, _ = _cu_want(ctx)
    for r, view in enumerate(ctx.inputs_run.views):
        cu_cpu = view.cu_seqlens_host
        if cu_cpu is None or cu_cpu.device.type != "cpu" or not torch.equal(cu_cpu.long(), want):
            fail(f"rank {r}: cu_seqlens_cpu is {None if cu_cpu is None else cu_cpu.tolist()}, verl passes a CPU "
                 f"copy {want.tolist()}")
