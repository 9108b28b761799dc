"""Planted bugs in the padding helpers."""

from __future__ import annotations

import torch

import impl
from impl.flags import read_flag


def slice_without_shift(tensor, data):
    """no_padding_2_padding reads values[e-r : e] (forgets the model's one-position shift)."""
    shifted = torch.nested.nested_tensor_from_jagged(torch.roll(tensor.values(), -1, 0), tensor.offsets())
    return impl.no_padding_2_padding(shifted, data)


def slice_masked_by_multiplication(tensor, data):
    """no_padding_2_padding zeroes the padding by multiplying with the mask (NaN * 0 = NaN)."""
    values, offsets = tensor.values(), tensor.offsets()
    resp = data["responses"].offsets().diff().to(values.device)
    width = int(read_flag(data, "max_response_len", None) or resp.max())
    cols = torch.arange(width, device=values.device)
    src = (offsets[1:] - resp - 1).unsqueeze(1) + cols
    valid = cols < resp.unsqueeze(1)
    out = values[src.clamp(max=values.shape[0] - 1)]
    return out * valid.view(*valid.shape, *([1] * (out.dim() - 2))).to(out.dtype)


def slice_lengths_from_loss_mask_sum(tensor, data):
    """Response lengths are taken as loss_mask.sum() (wrong when the mask has holes)."""
    resp = torch.stack([t.sum() for t in data["loss_mask"].unbind()]).clamp(min=1)
    fake = torch.nested.nested_tensor_from_jagged(torch.zeros(int(resp.sum())), torch.nn.functional.pad(resp.cumsum(0), (1, 0)))
    view = data.clone()
    del view["responses"]
    view["responses"] = fake
    return impl.no_padding_2_padding(tensor, view)


def left_right_mutating(data):
    """left_right_2_no_padding replaces keys of its input (as verl's pops input_ids)."""
    out = impl.left_right_2_no_padding(data)
    data.pop("input_ids")
    data.set("input_ids", out["input_ids"])
    return out


def as_nested_tensor_guessed(rows):
    """``torch.nested.as_nested_tensor(rows, layout=torch.jagged)`` as torch >= 2.5 guesses the ragged dim: rows of
    one shape come out ragged on their first dim (the 4 of a (4, n) mRoPE row), rows that differ in their second dim
    ragged on it. torch 2.4 refuses the second kind ("Cannot represent given tensor list as a nested tensor with the
    jagged layout"), so those rows are joined along that dim here, as the newer torch does."""
    if len({tuple(r.shape[1:]) for r in rows}) == 1:
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    offsets = torch.tensor([0] + [r.shape[1] for r in rows]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows, dim=1), offsets, jagged_dim=2)


def left_right_as_nested_positions(data):
    """left_right_2_no_padding builds mRoPE positions with as_nested_tensor (ragged dim guessed)."""
    out = impl.left_right_2_no_padding(data)
    pos = out["position_ids"]
    rows = list(pos.unbind())
    out["position_ids"] = as_nested_tensor_guessed(rows)
    return out


def mask_helper_ignores_width(input_ids, max_seq_len=None):
    """build_attention_mask_from_nested ignores max_seq_len (always max(n_i) wide)."""
    return impl.build_attention_mask_from_nested(input_ids)


def slice_ignores_width_flag(tensor, data):
    """no_padding_2_padding pads to max(r_i), ignoring the max_response_len flag."""
    view = data.clone()
    if "max_response_len" in view.keys():
        del view["max_response_len"]
    return impl.no_padding_2_padding(tensor, view)


def response_from_nested_no_shift(tensor, response_mask):
    """response_from_nested reads values[e-r : e] (forgets the one-position shift)."""
    shifted = torch.nested.nested_tensor_from_jagged(torch.roll(tensor.values(), -1, 0), tensor.offsets())
    return impl.response_from_nested(shifted, response_mask)


def response_to_nested_right_aligned(tensor, response_mask):
    """response_to_nested takes each row's last r_i columns instead of its first r_i."""
    lens = response_mask.offsets().diff()
    width = tensor.shape[1]
    rows = [tensor[i, width - int(n):] for i, n in enumerate(lens.tolist())]
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), response_mask.offsets())


def left_right_keeps_prompt_padding(data):
    """left_right_2_no_padding keeps each prompt's left padding in input_ids."""
    out = impl.left_right_2_no_padding(data)
    mask = data["attention_mask"].bool()
    width = data["response_mask"].shape[1]
    keep = mask.clone()
    keep[:, : mask.shape[1] - width] = True  # prompt columns, padding included
    ids = data["input_ids"][keep]
    lens = keep.sum(1)
    out["input_ids"] = torch.nested.nested_tensor_from_jagged(ids, torch.nn.functional.pad(lens.cumsum(0), (1, 0)))
    return out


def left_right_loss_mask_ones(data):
    """left_right_2_no_padding sets loss_mask to ones over the response (drops the mask's holes)."""
    out = impl.left_right_2_no_padding(data)
    loss = out["loss_mask"]
    out["loss_mask"] = torch.nested.nested_tensor_from_jagged(torch.ones_like(loss.values()), loss.offsets())
    return out


def left_right_drops_teacher(data):
    """left_right_2_no_padding leaves teacher top-K tensors dense."""
    out = impl.left_right_2_no_padding(data)
    for key in ("teacher_ids", "teacher_logprobs"):
        if key in data.keys():
            out[key] = data[key]
    return out


def left_right_drops_width_flag(data):
    """left_right_2_no_padding does not record max_response_len: slices come back max(r_i) wide."""
    out = impl.left_right_2_no_padding(data)
    del out["max_response_len"]
    return out


def left_right_routed_experts_uint8(data):
    """left_right_2_no_padding packs routed_experts into uint8 (to save memory) and back: expert ids above 255 wrap,
    only for MoE models of more than 256 experts (Kimi K2's 384, 512)."""
    out = impl.left_right_2_no_padding(data)
    routed = out.get("routed_experts") if "routed_experts" in out.keys() else None
    if isinstance(routed, torch.Tensor) and routed.is_nested:
        values = routed.values().to(torch.uint8).to(routed.dtype)
        out["routed_experts"] = torch.nested.nested_tensor_from_jagged(values, routed.offsets())
    return out


def left_right_routed_top1_squeezed(data):
    """left_right_2_no_padding squeezes size-1 dims of routed_experts (a top-1 router, one MoE layer): the nested
    tensor comes back (B, j, layers) or (B, j) instead of (B, j, layers, 1)."""
    out = impl.left_right_2_no_padding(data)
    routed = out.get("routed_experts") if "routed_experts" in out.keys() else None
    if isinstance(routed, torch.Tensor) and routed.is_nested and 1 in routed.values().shape[1:]:
        values = routed.values()
        kept = [values.shape[0], *[n for n in values.shape[1:] if n != 1]]
        out["routed_experts"] = torch.nested.nested_tensor_from_jagged(values.reshape(kept), routed.offsets())
    return out


def slice_empty_response_as_one(tensor, data):
    """no_padding_2_padding clamps each response length to at least one (to avoid an empty slice): an aborted
    rollout's row holds its last prompt position's value instead of zeros. Quiet: a zero-length response."""
    resp = data["responses"].offsets().diff()
    if bool((resp > 0).all()):
        return impl.no_padding_2_padding(tensor, data)
    values, offsets = tensor.values(), tensor.offsets()
    clamped = resp.clamp(min=1).to(values.device)
    width = int(read_flag(data, "max_response_len", None) or clamped.max())
    cols = torch.arange(width, device=values.device)
    src = (offsets[1:] - clamped - 1).unsqueeze(1) + cols
    valid = cols < clamped.unsqueeze(1)
    out = values[src.clamp(0, values.shape[0] - 1)]
    return torch.where(valid.view(*valid.shape, *([1] * (out.dim() - 2))), out, torch.zeros_like(out))
