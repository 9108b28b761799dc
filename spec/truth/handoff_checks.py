"""The checks of what ``prepare_model_inputs`` hands over, stated once: the padded attention mask, the padded and
packed ids and positions, the labels, the packed tail, the per-token and per-sample temperatures, what a fused model
is handed, ``cu_seqlens``. The invariants (spec/invariants/inputs.py) call them on the suite's run; a standalone
reproducer calls the same functions, vendored beside it (spec/repro/templates.py writes this module's source into
``repro_suite.py``; spec/repro/runtime.py calls them). So they take plain values (lengths, the declared padded layout,
the tensors one or every rank handed over), import only torch and the contract's rules, and fail by
:func:`~spec.truth.failing.fail`: an AssertionError whose ``facts`` say what failed (known-failure records match them).
"""

from __future__ import annotations

import torch

from ..protocol.engine import PaddedLayout
from .failing import fail
from .rules import full_length_mask, layout_columns, layout_mask, layout_width, offsets, padded_length

__all__ = ["padded_mask", "padded_mask_shape", "mask_dtype", "mask_dtype_device", "padded_rows", "padding_fill", "packed_inputs",
           "next_token_labels", "rolled_row", "joined", "packed_tail", "packed_tail_rule", "tail_fill", "token_temperatures_handed",
           "per_token_temperature", "padded_temperature", "fused_inputs", "fused_return_dict", "cu_seqlens_want", "cu_seqlens", "cu_seqlens_host",
           "mask_helper", "MASK_DTYPES"]

#: the dtypes a padded attention mask may have: 0/1 in an integer or bool dtype (a float mask reads as an additive
#: bias in Hugging Face models, so 0.0/1.0 is not a 0/1 mask there)
#: the dtypes a padded attention mask may have: 0/1 in an integer or bool dtype, or (a 2-D mask only) 0.0/1.0 in a
#: floating dtype: a Hugging Face model casts a 2-D mask to bool (``masking_utils``; before it,
#: ``_prepare_4d_attention_mask`` read 1.0 as keep), and only a 4-D mask is an additive bias
MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _layout_words(layout) -> str:
    return "" if PaddedLayout(layout) is PaddedLayout.RIGHT else f" in the declared {PaddedLayout(layout).value} layout"


def padded_mask(prompt_lens, response_lens, layout, mask) -> None:
    """INV-MASK-001: padded attention mask row i marks exactly sample i's tokens where the declared layout puts them
    (the full sequence, not the response-only loss mask), at the mask's own width."""
    if mask is None:
        fail("padded mode returned attention_mask=None, expected the (B, L) mask")
    want = layout_mask(prompt_lens, response_lens, layout, mask.shape[-1])
    got = mask.detach().to("cpu", torch.int64)
    if got.shape != want.shape or not torch.equal(got, want):
        rows = [r for r in range(min(got.shape[0], want.shape[0])) if not torch.equal(got[r], want[r])]
        row = rows[0] if rows else 0
        fail(f"attention_mask row {row} is {got[row].tolist()}, expected {want[row].tolist()}{_layout_words(layout)} "
             f"(sequence length {int(prompt_lens[row]) + int(response_lens[row])}, response length "
             f"{response_lens[row]})", key="attention_mask", sequence=row)


def padded_mask_shape(prompt_lens, response_lens, layout, mask) -> None:
    """INV-MASK-003: the padded attention mask is (B, the declared layout's width) and sums to total_nnz."""
    if mask is None:
        fail("padded mode returned attention_mask=None, expected the (B, L) mask")
    want = (len(prompt_lens), layout_width(prompt_lens, response_lens, layout))
    if tuple(mask.shape) != want:
        fail(f"attention_mask shape {tuple(mask.shape)}, expected {want}")
    total = sum(int(p) + int(r) for p, r in zip(prompt_lens, response_lens))
    if int(mask.sum()) != total:
        fail(f"attention_mask sums to {int(mask.sum())}, total_nnz is {total}")


def mask_dtype(mask, what: str, int32: bool, convention: str = "int32_attention_mask") -> None:
    """INV-MASK-002/004's dtype: an integer or bool dtype, or a 2-D floating mask of 0.0/1.0 only (a model reads any
    other float value, or a float mask of another rank, as an additive bias); int32 where the engine promises verl's
    convention (``int32``: its profile declares ``convention``)."""
    if int32:
        if mask.dtype != torch.int32:
            fail(f"{what} dtype is {mask.dtype}, expected torch.int32 (the engine's profile declares "
                 f"{convention})", key="attention_mask")
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


def mask_dtype_device(mask, ids, device, int32: bool, convention: str = "int32_attention_mask") -> None:
    """INV-MASK-002: the padded attention mask is 0/1 in an integer or bool dtype, or a 2-D 0.0/1.0 float mask (int32
    under the convention), on the ids' device, the batch's (``device``)."""
    if mask is None:
        fail("padded mode returned attention_mask=None, expected the (B, L) mask")
    mask_dtype(mask, "attention_mask", int32, convention)
    if mask.device != ids.device or mask.device.type != torch.device(device).type:
        fail(f"attention_mask on {mask.device}, input_ids on {ids.device}, batch on {device}")


def mask_helper(build, ids, seq_lens, int32: bool, convention: str = "int32_attention_mask") -> None:
    """INV-MASK-004: ``build_attention_mask_from_nested`` gives the full lengths at any width (its own, and two
    columns wider), 0/1 in an integer or bool dtype (int32 where the engine promises verl's convention)."""
    for width in (None, max(seq_lens) + 2):
        mask = build(ids) if width is None else build(ids, max_seq_len=width)
        want = full_length_mask(seq_lens, width or max(seq_lens), torch.int32)  # at the width asked for
        mask_dtype(mask, f"build_attention_mask_from_nested(max_seq_len={width})", int32, convention)
        if tuple(mask.shape) != (len(seq_lens), width or max(seq_lens)) or not torch.equal(mask.cpu().to(torch.int32),
                                                                                          want):
            # the first wrong row (its whole row when the widths differ): a message of one row at any batch size
            rows = mask.shape[0] if mask.dim() == 2 else 0
            row = next((i for i in range(min(rows, len(seq_lens)))
                        if not torch.equal(mask[i].cpu().to(torch.int32), want[i])), 0)
            fail(f"build_attention_mask_from_nested(max_seq_len={width}): a {tuple(mask.shape)} mask where "
                 f"{tuple(want.shape)} was expected; sample {row} (length {seq_lens[row]}) gave "
                 f"{mask[row:row + 1].tolist()} ({mask.dtype}), expected {want[row:row + 1].tolist()}")


def padded_rows(prompt_lens, response_lens, layout, rows, got, key: str, what: str) -> None:
    """INV-INPUT-001, INV-POS-001: each row of a padded model input ``got`` (``(B, L)`` or ``(C, B, L)``) holds that
    sample's values ``rows[i]`` in order at the columns the declared layout puts them (verl's: from column 0)."""
    rows = [t.cpu() for t in rows]
    got = got.cpu()
    width = layout_width(prompt_lens, response_lens, layout)
    channels = (rows[0].shape[0],) if rows[0].dim() == 2 else ()
    want_shape = (*channels, len(rows), width)
    if tuple(got.shape) != want_shape:
        fail(f"padded {key} shape {tuple(got.shape)}, expected {want_shape}{_layout_words(layout)}")
    for i, (row, cols) in enumerate(zip(rows, layout_columns(prompt_lens, response_lens, layout))):
        have = got[..., i, cols]
        if not torch.equal(have, row.to(have.dtype)):
            fail(f"padded {key} row {i} holds {have.tolist()} at columns {cols.tolist()}, expected the {what} "
                 f"{row.tolist()}{_layout_words(layout)}", key=key, sequence=i)


def padding_fill(prompt_lens, response_lens, layout, got, fill: int, key: str) -> None:
    """INV-INPUT-002, INV-POS-003: every padding column of a padded model input (those the declared layout leaves
    to padding) holds ``fill``."""
    got = got.cpu()
    pad = ~layout_mask(prompt_lens, response_lens, layout, got.shape[-1]).bool()
    values = got[..., pad]
    if values.numel() and bool((values != fill).any()):
        fail(f"padded {key} hold {sorted(set(values.reshape(-1).tolist()))[:8]} in the padding, "
             f"expected {fill} (verl's fill)")


def joined(parts) -> torch.Tensor:
    """Every rank's part of a packed model input or hand-off, joined along the tokens (CPU)."""
    return torch.cat([p.cpu() for p in parts], dim=-1)


def packed_inputs(masks, ids_parts, pos_parts, mrope: bool, ids, positions) -> None:
    """INV-POS-002: packed inputs, on every rank: ids (1, n), positions (1, n) or (4, 1, n) (mRoPE), no mask; the ranks'
    slices join to the packed row, which starts with the sequences' ``ids`` and ``positions`` (their values)."""
    total = ids.shape[-1]
    for r, (mask, rank_ids, pos) in enumerate(zip(masks, ids_parts, pos_parts)):
        if mask is not None:
            fail(f"rank {r}: packed attention_mask {tuple(mask.shape)}, expected None")
        if rank_ids.dim() != 2 or rank_ids.shape[0] != 1:
            fail(f"rank {r}: packed input_ids shape {tuple(rank_ids.shape)}, expected (1, n)")
        if pos is None:
            fail(f"rank {r}: a packed row handed without position_ids: the model cannot find its sequences' "
                 "boundaries (they are where the positions restart at 0)", key="position_ids")
        want_pos = (4, 1, rank_ids.shape[1]) if mrope else (1, rank_ids.shape[1])
        if tuple(pos.shape) != want_pos:
            fail(f"rank {r}: packed position_ids shape {None if pos is None else tuple(pos.shape)}, expected {want_pos}")
    row = joined(ids_parts)[0]
    pos = joined(pos_parts)
    if row.shape[0] < total or not torch.equal(row[:total], ids.cpu()):
        fail(f"packed input_ids {row.tolist()}, expected them to start with the sequences' ids {ids.tolist()}")
    want_pos = positions.cpu()
    got_pos = pos[..., 0, :total] if mrope else pos[0, :total]
    if not torch.equal(got_pos, want_pos):
        fail(f"packed position_ids {got_pos.tolist()}, expected {want_pos.tolist()}")


def _labels(labels) -> torch.Tensor:
    """The labels every rank hands its output step, joined (one per packed token)."""
    if any(lab is None for lab in labels):
        fail("the engine hands no labels (the ids its log-probs score) to its output step, expected the rolled ids")
    return torch.cat([lab.reshape(-1).cpu() for lab in labels])


def next_token_labels(labels, ids, seq_lens, where: str) -> None:
    """INV-LABEL-001/002: the label of every packed token but each sequence's last is the next token of its sequence
    (``labels``: every rank's, joined in rank order; ``ids``: the packed row's values)."""
    labels, ids = _labels(labels), ids.cpu()
    if labels.shape[0] < ids.shape[0]:
        fail(f"the rolled labels have {labels.shape[0]} labels for {ids.shape[0]} tokens")
    ends = offsets(seq_lens)[1:] - 1
    inner = torch.ones(ids.shape[0], dtype=torch.bool)
    inner[ends] = False
    k = inner.nonzero().squeeze(1)
    bad = (labels[k] != ids[k + 1]).nonzero()
    if bad.numel():
        pos = int(k[bad[0, 0]])
        fail(f"label at packed position {pos} is {int(labels[pos])}, expected the next token {int(ids[pos + 1])} "
             f"({where}; ids {ids.tolist()}, labels {labels[: ids.shape[0]].tolist()})")


def rolled_row(labels, ids) -> None:
    """INV-LABEL-003: the labels are the whole packed row rolled left by one (the wrap at each sequence end
    included), padded after the roll with 0."""
    labels, ids = _labels(labels), ids.cpu()
    want = torch.roll(ids, -1)
    total = ids.shape[0]
    if labels.shape[0] < total or not torch.equal(labels[:total], want):
        fail(f"rolled labels {labels[:total].tolist()}, expected the packed row rolled by one "
             f"{want.tolist()} (the roll comes before any bucket or sequence-parallel padding)")
    if bool((labels[total:] != 0).any()):
        fail(f"labels of the tail padding are {labels[total:].tolist()}, expected zeros")


def _tail_row(ids_parts, total: int, bucket, sp_size: int, multiple=None) -> torch.Tensor:
    padded = padded_length(total, bucket, sp_size, multiple)
    row = joined(ids_parts)[0]
    if row.shape[0] != padded:
        fail(f"packed row has {row.shape[0]} tokens, expected {padded} (total_nnz={total}, "
             f"bucket={bucket}, tail multiple={multiple}, sp={sp_size})")
    return row


def packed_tail(ids_parts, pos_parts, pad_size, total: int, bucket, sp_size: int, multiple, mrope: bool) -> None:
    """INV-PAD-001: the packed tail padding's length is total_nnz rounded up to the bucket (then the engine's tail
    multiple), then to sp; ``pad_size`` reports it; its positions restart at 0 (the pad never joins the last
    sequence)."""
    row = _tail_row(ids_parts, total, bucket, sp_size, multiple)
    pad = row.shape[0] - total
    if int(pad_size) != pad:
        fail(f"pad_size is {pad_size}, expected {pad}")
    if pad:
        pos = joined(pos_parts)
        tail_pos = (pos[0, 0] if mrope else pos[0])[total:]
        if int(tail_pos[0]) != 0:
            fail(f"tail positions {tail_pos.tolist()[:8]}, expected them to restart at 0 (else the pad joins the last "
                 "sequence)")


def packed_tail_rule(ids_parts, total: int, bucket, sp_size: int, multiple: int) -> None:
    """INV-PAD-003: under the engine's own tail rule the packed row has total_nnz tokens rounded up to the bucket,
    then to ``multiple``, then to sp (what the rule is for: a kernel's block, an even split). What the tail holds is
    the engine's: no output reads it (INV-LEAK-002)."""
    _tail_row(ids_parts, total, bucket, sp_size, multiple)


def token_temperatures_handed(temps) -> torch.Tensor:
    """The per-token temperature every rank hands its output step, joined (packed)."""
    if any(not isinstance(t, torch.Tensor) for t in temps):
        fail(f"the packed hand-off carries temperature {temps[0]!r}, expected one per token")
    return torch.cat([t.reshape(-1).cpu() for t in temps])


def tail_fill(ids_parts, temps, total: int, bucket, sp_size: int, multiple) -> None:
    """INV-PAD-002: the packed tail padding holds id 0 and temperature 1."""
    row = _tail_row(ids_parts, total, bucket, sp_size, multiple)
    tail = token_temperatures_handed(temps)[total:]
    if bool((row[total:] != 0).any()):
        fail(f"tail ids {row[total:].tolist()[:8]}, expected zeros (verl's fill)")
    if not torch.equal(tail, torch.ones_like(tail)):
        fail(f"tail temperature {tail.tolist()[:8]}, expected ones (verl's fill)")


def per_token_temperature(temps, want) -> None:
    """INV-TEMP-004: the packed per-token temperature repeats each sample's temperature over its tokens (``want``)."""
    got = token_temperatures_handed(temps)[: want.shape[0]]
    if not torch.allclose(got.float(), want):
        fail(f"per-token temperature {got.tolist()}, expected {want.tolist()}")


def padded_temperature(got, per_sample, per_token) -> None:
    """INV-TEMP-005: the padded hand-off is each sample's temperature, (B,), or each token's, (total_nnz,)."""
    if isinstance(got, torch.Tensor):
        flat = got.detach().cpu().float()
        for want in (per_sample, per_token):
            if tuple(flat.shape) == tuple(want.shape) and torch.allclose(flat, want, rtol=1e-6, atol=0):
                return
    fail(f"the padded hand-off carries temperature {got!r}, expected the per-sample {per_sample.tolist()} (or "
         "that per token)")


def fused_inputs(model_temperatures, model_labels, labels, temperature: float, packed: bool) -> None:
    """INV-FUSED-001: every rank's fused model is handed one float temperature; packed, its shift_labels are the rolled
    ids (the labels the rank hands its output step) as (1, n)."""
    if packed:
        _labels(labels)  # every rank hands its labels
    for r, (temp, shift, rolled) in enumerate(zip(model_temperatures, model_labels, labels)):
        if isinstance(temp, torch.Tensor) or not isinstance(temp, (int, float)) or abs(float(temp) - temperature) > 1e-6:
            fail(f"rank {r}: the model is handed temperature {temp!r}, expected the float {temperature}")
        if packed:
            rolled = rolled.reshape(-1)
            if shift is None or tuple(shift.shape) != (1, rolled.shape[0]) or not torch.equal(shift[0].cpu(),
                                                                                             rolled.cpu()):
                fail(f"rank {r}: the model's labels (shift_labels) {None if shift is None else shift.tolist()}, "
                     f"expected the rolled ids {rolled.tolist()} as (1, n)")


def fused_return_dict(handed) -> None:
    """INV-FUSED-002: every rank's fused model is handed return_dict=True."""
    for r, value in enumerate(handed):
        if value is not True:
            fail(f"rank {r}: the model is handed return_dict={value!r}, expected True (as verl passes it)")


def cu_seqlens_want(seq_lens, padded: int) -> torch.Tensor:
    """The cu_seqlens of a packed row of ``padded`` tokens: the sequences' offsets, plus a final boundary at
    ``padded`` when tail padding was appended."""
    want = offsets(seq_lens)
    return want if padded == int(want[-1]) else torch.cat([want, torch.tensor([padded])])


def cu_seqlens(handed, ids_parts, seq_lens) -> None:
    """INV-CU-001: every rank's model is handed cu_seqlens = the input offsets (plus a final boundary when padding
    was appended), integers on the ids' device."""
    padded = joined(ids_parts).shape[-1]
    want = cu_seqlens_want(seq_lens, padded)
    for r, (cu, ids) in enumerate(zip(handed, ids_parts)):
        if cu is None:
            fail(f"rank {r}: the model is handed no cu_seqlens, expected {want.tolist()}")
        # The contract fixes no dtype (flash-attn wants int32, which impl gives; verl gives int64).
        if cu.dtype not in (torch.int32, torch.int64) or cu.device.type != ids.device.type:
            fail(f"rank {r}: cu_seqlens is {cu.dtype} on {cu.device}, expected integers on {ids.device}")
        if not torch.equal(cu.cpu().long(), want):
            fail(f"rank {r}: cu_seqlens {cu.tolist()}, expected {want.tolist()} for a packed row of {padded} tokens")


def cu_seqlens_host(handed, ids_parts, seq_lens) -> None:
    """INV-CU-002: every rank's model is also handed a CPU copy cu_seqlens_cpu equal to cu_seqlens."""
    want = cu_seqlens_want(seq_lens, joined(ids_parts).shape[-1])
    for r, host in enumerate(handed):
        if host is None or host.device.type != "cpu" or not torch.equal(host.long(), want):
            fail(f"rank {r}: cu_seqlens_cpu is {None if host is None else host.tolist()}, expected a CPU copy "
                 f"{want.tolist()} (as verl passes it)")
