"""Invariants on prepare_model_inputs: mask, dense and packed inputs, labels, tail padding."""

from __future__ import annotations

import torch

from .core import Ctx, fail, invariant

PADDED = ("padded",)
PACKED = ("packed",)


def _values(ctx: Ctx, key: str) -> torch.Tensor:
    return ctx.inputs_run.micro_batch[key].values()


def _lens(ctx: Ctx) -> torch.Tensor:
    return torch.tensor(ctx.case.seq_lens)


@invariant("INV-MASK-001", "padded attention mask row i has exactly n_i leading ones (full sequence, "
           "not the response-only loss mask)", contract=1, modes=PADDED)
def mask_values(ctx: Ctx) -> None:
    mask = ctx.inputs_run.inputs[0]["attention_mask"]
    if mask is None:
        fail("padded mode returned attention_mask=None")
    lens = _lens(ctx)
    want = (torch.arange(mask.shape[-1]).unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64)
    got = mask.detach().to("cpu", torch.int64)
    if got.shape != want.shape or not torch.equal(got, want):
        rows = [r for r in range(min(got.shape[0], want.shape[0])) if not torch.equal(got[r], want[r])]
        row = rows[0] if rows else 0
        fail(f"attention_mask row {row} is {got[row].tolist()}, expected {want[row].tolist()} "
             f"(sequence length {int(lens[row])}, response length {ctx.case.response_lens[row]})")


@invariant("INV-MASK-002", "padded attention mask is int32 on the ids' device", contract=1, modes=PADDED)
def mask_dtype_device(ctx: Ctx) -> None:
    mi = ctx.inputs_run.inputs[0]
    mask, ids = mi["attention_mask"], mi["input_ids"]
    if mask.dtype != torch.int32:
        fail(f"attention_mask dtype is {mask.dtype}, expected torch.int32")
    if mask.device != ids.device or mask.device.type != torch.device(ctx.device).type:
        fail(f"attention_mask on {mask.device}, input_ids on {ids.device}, batch on {ctx.device}")


@invariant("INV-MASK-003", "padded attention mask is (B, max_seq_len) and sums to total_nnz", contract=1,
           modes=PADDED)
def mask_shape_sum(ctx: Ctx) -> None:
    mask = ctx.inputs_run.inputs[0]["attention_mask"]
    want = (ctx.case.batch_size, max(ctx.case.seq_lens))
    if tuple(mask.shape) != want:
        fail(f"attention_mask shape {tuple(mask.shape)}, expected {want}")
    if int(mask.sum()) != ctx.case.total_nnz:
        fail(f"attention_mask sums to {int(mask.sum())}, total_nnz is {ctx.case.total_nnz}")


@invariant("INV-MASK-004", "build_attention_mask_from_nested gives the full lengths, int32, any width",
           contract=1, modes=("any",), needs=("build_attention_mask_from_nested",))
def mask_helper(ctx: Ctx) -> None:
    build = ctx.helper("build_attention_mask_from_nested")
    ids = ctx.batch["input_ids"]
    lens = _lens(ctx)
    for width in (None, max(ctx.case.seq_lens) + 2):
        mask = build(ids) if width is None else build(ids, max_seq_len=width)
        cols = mask.shape[-1]
        want = (torch.arange(cols).unsqueeze(0) < lens.unsqueeze(1)).to(torch.int32)
        if mask.dtype != torch.int32 or tuple(mask.shape) != (len(lens), width or max(lens)) \
                or not torch.equal(mask.cpu(), want):
            fail(f"build_attention_mask_from_nested(max_seq_len={width}) gave {mask.tolist()} "
                 f"({mask.dtype}), expected {want.tolist()}")


@invariant("INV-INPUT-001", "padded input_ids hold each sequence then pad_token_id, (B, max_seq_len)",
           contract=1, modes=PADDED)
def padded_ids(ctx: Ctx) -> None:
    ids = ctx.inputs_run.inputs[0]["input_ids"].cpu()
    rows = [t.cpu() for t in ctx.inputs_run.micro_batch["input_ids"].unbind()]
    width = max(ctx.case.seq_lens)
    want = torch.full((len(rows), width), ctx.case.pad_token_id, dtype=ids.dtype)
    for i, row in enumerate(rows):
        want[i, : len(row)] = row
    if tuple(ids.shape) != tuple(want.shape) or not torch.equal(ids, want):
        fail(f"padded input_ids {ids.tolist()}, expected {want.tolist()}")


@invariant("INV-POS-001", "padded position_ids are (B, L) or (4, B, L) (mRoPE), values kept, 0 on padding",
           contract=1, modes=PADDED)
def padded_positions(ctx: Ctx) -> None:
    pos = ctx.inputs_run.inputs[0]["position_ids"].cpu()
    rows = [t.cpu() for t in ctx.inputs_run.micro_batch["position_ids"].unbind()]
    width = max(ctx.case.seq_lens)
    if ctx.case.mrope:
        want = torch.zeros(rows[0].shape[0], len(rows), width, dtype=pos.dtype)
        for i, row in enumerate(rows):
            want[:, i, : row.shape[-1]] = row
    else:
        want = torch.zeros(len(rows), width, dtype=pos.dtype)
        for i, row in enumerate(rows):
            want[i, : len(row)] = row
    if tuple(pos.shape) != tuple(want.shape) or not torch.equal(pos, want):
        fail(f"padded position_ids shape {tuple(pos.shape)} {pos.tolist()}, expected {tuple(want.shape)} "
             f"{want.tolist()}")


def _joined(ctx: Ctx, key: str, dim: int = -1) -> torch.Tensor:
    return torch.cat([mi[key].cpu() for mi in ctx.inputs_run.inputs], dim=dim)


@invariant("INV-POS-002", "packed inputs: ids (1, n), positions (1, n) or (4, 1, n), no mask; ranks' "
           "slices concatenate to the packed row", contract=5, modes=PACKED)
def packed_inputs(ctx: Ctx) -> None:
    total = ctx.case.total_nnz
    for r, mi in enumerate(ctx.inputs_run.inputs):
        if mi.get("attention_mask") is not None:
            fail(f"rank {r}: packed attention_mask must be None")
        ids, pos = mi["input_ids"], mi["position_ids"]
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


@invariant("INV-PAD-001", "packed tail padding: length rounded up to the bucket then to sp, ids 0, "
           "positions restart at 0, temperature 1, pad_size reported", contract=7, modes=PACKED, needs=("bucket",),
           adjust=lambda c: c.with_(pad_to_length=c.pad_to_length or 8, distillation_keys=(),
                                    distillation_only=False))
def packed_tail(ctx: Ctx) -> None:
    case = ctx.case
    total = case.total_nnz
    padded = total if not case.pad_to_length else -(-total // case.pad_to_length) * case.pad_to_length
    padded = -(-padded // case.sp_size) * case.sp_size
    ids = _joined(ctx, "input_ids")[0]
    if ids.shape[0] != padded:
        fail(f"packed row has {ids.shape[0]} tokens, expected {padded} (total_nnz={total}, "
             f"bucket={case.pad_to_length}, sp={case.sp_size})")
    pad = padded - total
    reported = ctx.inputs_run.output_args[0].get("pad_size", 0)
    if int(reported) != pad:
        fail(f"output_args['pad_size'] is {reported}, expected {pad}")
    if pad:
        pos = _joined(ctx, "position_ids")
        tail_pos = (pos[0, 0] if case.mrope else pos[0])[total:]
        temps = torch.cat([a["temperature_rmpad"].cpu() for a in ctx.inputs_run.output_args])[total:]
        if bool((ids[total:] != 0).any()):
            fail(f"tail ids {ids[total:].tolist()}, expected zeros")
        if int(tail_pos[0]) != 0:
            fail(f"tail positions {tail_pos.tolist()} must restart at 0 (else the pad joins the last sequence)")
        if not torch.equal(temps, torch.ones_like(temps)):
            fail(f"tail temperature {temps.tolist()}, expected ones")


def _rolled(ctx: Ctx) -> torch.Tensor:
    return torch.cat([a["input_ids_rmpad_rolled"].reshape(-1).cpu() for a in ctx.inputs_run.output_args])


def _check_labels(ctx: Ctx, where: str) -> None:
    labels = _rolled(ctx)
    ids = _values(ctx, "input_ids").cpu()
    if labels.shape[0] < ids.shape[0]:
        fail(f"input_ids_rmpad_rolled has {labels.shape[0]} labels for {ids.shape[0]} tokens")
    ends = torch.tensor(ctx.case.seq_lens).cumsum(0) - 1
    inner = torch.ones(ids.shape[0], dtype=torch.bool)
    inner[ends] = False
    k = inner.nonzero().squeeze(1)
    bad = (labels[k] != ids[k + 1]).nonzero()
    if bad.numel():
        pos = int(k[bad[0, 0]])
        fail(f"label at packed position {pos} is {int(labels[pos])}, the next token is {int(ids[pos + 1])} "
             f"({where}; ids {ids.tolist()}, labels {labels[: ids.shape[0]].tolist()})")


@invariant("INV-LABEL-001", "rolled labels hold the next token inside every sequence", contract=5)
def labels_next_token(ctx: Ctx) -> None:
    _check_labels(ctx, "inside a sequence")


@invariant("INV-LABEL-002", "with sequence parallelism no label is read across a shard edge (roll the "
           "global row, then slice)", contract=5, modes=PACKED, needs=("sp",),
           adjust=lambda c: c.with_(sp_size=max(c.sp_size, 2), distillation_keys=(), distillation_only=False))
def labels_shard_edges(ctx: Ctx) -> None:
    _check_labels(ctx, f"sp={ctx.case.sp_size}: a shard edge")


@invariant("INV-TEMP-004", "packed temperature_rmpad repeats each sample's temperature over its tokens",
           contract=6, modes=PACKED, adjust=lambda c: c if c.use_fused_kernels else c.with_(
               temperature=tuple(0.5 + 0.25 * i for i in range(c.batch_size))))
def temperature_rmpad(ctx: Ctx) -> None:
    got = torch.cat([a["temperature_rmpad"].reshape(-1).cpu() for a in ctx.inputs_run.output_args])[: ctx.case.total_nnz]
    want = torch.repeat_interleave(torch.tensor(ctx.case.temperatures(), dtype=torch.float32),
                                   torch.tensor(ctx.case.seq_lens))
    if not torch.allclose(got.float(), want):
        fail(f"temperature_rmpad {got.tolist()}, expected {want.tolist()}")


@invariant("INV-FUSED-001", "fused kernels: one float temperature and return_dict=True reach the model; "
           "packed shift_labels are the rolled ids (1, n)", contract=6, needs=("fused",),
           adjust=lambda c: c.with_(use_fused_kernels=True, temperature=c.temperatures()[0],
                                    distillation_keys=(), distillation_only=False, calculate_sum_pi_squared=False))
def fused_inputs(ctx: Ctx) -> None:
    for r, mi in enumerate(ctx.inputs_run.inputs):
        temp = mi.get("temperature")
        if isinstance(temp, torch.Tensor) or not isinstance(temp, (int, float)) \
                or abs(float(temp) - ctx.case.temperatures()[0]) > 1e-6:
            fail(f"rank {r}: model_inputs['temperature'] is {temp!r}, expected the float {ctx.case.temperature}")
        if mi.get("return_dict") is not True:
            fail(f"rank {r}: model_inputs['return_dict'] is {mi.get('return_dict')!r}, expected True")
        if ctx.case.use_remove_padding:
            labels = mi.get("shift_labels")
            rolled = ctx.inputs_run.output_args[r]["input_ids_rmpad_rolled"].reshape(-1)
            if labels is None or tuple(labels.shape) != (1, rolled.shape[0]) \
                    or not torch.equal(labels[0].cpu(), rolled.cpu()):
                fail(f"rank {r}: shift_labels {None if labels is None else labels.tolist()}, expected the "
                     f"rolled ids {rolled.tolist()} as (1, n)")


@invariant("INV-LABEL-003", "the rolled labels are the whole packed row rolled left by one (the wrap at "
           "each sequence end included), padded after the roll with 0", contract=5, modes=PACKED,
           needs=("bucket",), adjust=lambda c: c.with_(pad_to_length=c.pad_to_length or 8, distillation_keys=(),
                                    distillation_only=False))
def labels_whole_row(ctx: Ctx) -> None:
    labels = _rolled(ctx)
    ids = _values(ctx, "input_ids").cpu()
    want = torch.roll(ids, -1)
    total = ids.shape[0]
    if labels.shape[0] < total or not torch.equal(labels[:total], want):
        fail(f"input_ids_rmpad_rolled {labels[:total].tolist()}, expected the packed row rolled by one "
             f"{want.tolist()} (the roll comes before any bucket or sequence-parallel padding)")
    if bool((labels[total:] != 0).any()):
        fail(f"labels of the tail padding are {labels[total:].tolist()}, expected zeros")


@invariant("INV-CU-001", "with cu_seqlens passed: cu_seqlens = the input offsets (plus a final boundary "
           "when padding was appended), integers on the ids' device, and a CPU copy", contract=1, modes=PACKED,
           needs=("cu_seqlens",), adjust=lambda c: c.with_(pass_cu_seqlens=True))
def cu_seqlens(ctx: Ctx) -> None:
    case = ctx.case
    offsets = torch.tensor((0, *case.seq_lens)).cumsum(0)
    padded = _joined(ctx, "input_ids").shape[-1]
    want = offsets if padded == case.total_nnz else torch.cat([offsets, torch.tensor([padded])])
    for r, mi in enumerate(ctx.inputs_run.inputs):
        cu, cu_cpu = mi.get("cu_seqlens"), mi.get("cu_seqlens_cpu")
        if cu is None or cu_cpu is None:
            fail(f"rank {r}: model_inputs lack cu_seqlens/cu_seqlens_cpu (keys {sorted(mi)})")
        # The contract fixes no dtype (flash-attn wants int32, which impl gives; verl gives int64).
        if cu.dtype not in (torch.int32, torch.int64) or cu.device.type != mi["input_ids"].device.type:
            fail(f"rank {r}: cu_seqlens is {cu.dtype} on {cu.device}, expected integers on {mi['input_ids'].device}")
        if cu_cpu.device.type != "cpu" or not torch.equal(cu.cpu().long(), want) \
                or not torch.equal(cu_cpu.long(), want):
            fail(f"rank {r}: cu_seqlens {cu.tolist()} (cpu copy {cu_cpu.tolist()} on {cu_cpu.device}), "
                 f"expected {want.tolist()} for a packed row of {padded} tokens")
