"""Padding helpers: the attention mask, the response slice, and dense-to-nested conversion.

The response slice rule lives here once (:func:`_response_rows`): the model's output at
packed position k scores token k+1, so the response of sequence i, ending at
``e_i = cu_seqlens[i+1]`` with ``r_i`` tokens, is read from
``values[e_i - r_i - 1 : e_i - 1]``. It needs a prompt of at least one token.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from .dense import jagged_to_padded, padded_to_jagged
from .errors import BatchMismatchError, NestedLayoutError, ShapeError
from .flags import read_flag
from .layout import SequenceLayout, nested_from_values

__all__ = [
    "build_attention_mask_from_nested",
    "response_lengths",
    "no_padding_2_padding",
    "response_from_nested",
    "response_to_nested",
    "left_right_2_no_padding",
]


def build_attention_mask_from_nested(input_ids: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
    """``(B, max_seq_len)`` int32 mask from the *full* sequence lengths of nested ``input_ids``."""
    return SequenceLayout.of(input_ids, "input_ids").mask(max_seq_len)


def response_lengths(data: TensorDictBase, device: torch.device) -> torch.Tensor:
    """``(B,)`` int64 response lengths ``r_i`` of a micro-batch.

    Taken from nested ``responses``, else the lengths of a nested ``response_mask`` /
    ``loss_mask``, else (dense batches) the ones of ``attention_mask`` over the
    response columns.
    """
    for key in ("responses", "response_mask", "loss_mask"):
        value = data.get(key, None) if key in data.keys() else None
        if isinstance(value, torch.Tensor) and value.is_nested:
            return SequenceLayout.of(value, key).lengths.to(device)
    if "attention_mask" in data.keys() and "response_mask" in data.keys():
        width = data.get("response_mask").shape[-1]
        return data.get("attention_mask")[:, -width:].sum(-1).to(device=device, dtype=torch.int64)
    raise KeyError("cannot find the response lengths: the micro-batch needs nested 'responses' "
                   f"(or a nested 'response_mask'/'loss_mask'); keys: {sorted(data.keys())}")


def _response_rows(values: torch.Tensor, offsets: torch.Tensor, resp_lens: torch.Tensor, width: int,
                   key: str) -> torch.Tensor:
    """``(B, width, *)``: row i starts with the ``r_i`` outputs that score response i.

    Entries past ``r_i`` are *not* cleared (they hold what follows in the packed row).
    Rows are cut from one partition of the packed row, ``[s_i, s_{i+1})`` with
    ``s_i = e_i - r_i - 1``, so a single jagged-to-dense pass does the gather.
    """
    seq_lens = offsets.diff()
    if seq_lens.shape != resp_lens.shape:
        raise BatchMismatchError(f"{key!r} holds {seq_lens.shape[0]} sequences but there are "
                                 f"{resp_lens.shape[0]} responses")
    starts = offsets[1:] - resp_lens - 1
    min_prompt, min_resp, first = torch.stack([(seq_lens - resp_lens).min(), resp_lens.min(), starts[0]]).tolist()
    if min_prompt < 1 or min_resp < 0:
        raise ShapeError(
            f"{key!r}: every sequence needs a prompt of >= 1 token before its response to slice the "
            f"response; sequence lengths {seq_lens.tolist()}, response lengths {resp_lens.tolist()}")
    bounds = torch.cat([starts, offsets[-1:]]) - first
    return jagged_to_padded(values[first:], bounds, width, 0)


def _values_and_offsets(tensor: torch.Tensor, data: TensorDictBase, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(tensor, torch.Tensor) and tensor.is_nested:
        layout = SequenceLayout.of(tensor, key)
        return layout.values, layout.offsets
    if not isinstance(tensor, torch.Tensor):
        raise NestedLayoutError(f"{key!r} must be a tensor, got {type(tensor).__name__}")
    layout = SequenceLayout.of(data.get("input_ids"), "input_ids")
    if tensor.shape[0] != layout.total_nnz:
        raise ShapeError(f"{key!r} has shape {tuple(tensor.shape)}; a packed tensor needs "
                         f"total_nnz={layout.total_nnz} rows")
    return tensor, layout.offsets.to(tensor.device)


def no_padding_2_padding(tensor: torch.Tensor, data: TensorDictBase) -> torch.Tensor:
    """Slice each response out of per-token outputs: ``(B, max_response_len, *)``, zero-padded.

    ``tensor`` is nested over the full sequences (or packed ``(total_nnz, *)``).
    The width is the ``max_response_len`` flag if set, else ``max(r_i)``.
    """
    values, offsets = _values_and_offsets(tensor, data, "tensor")
    resp_lens = response_lengths(data, values.device)
    width = read_flag(data, "max_response_len", None)
    if width is None:
        width = read_flag(data, "max_response_length", None)
    longest = int(resp_lens.max())
    width = longest if width is None else int(width)
    if width < longest:
        raise ShapeError(f"flag 'max_response_len'={width} is smaller than the longest response ({longest})")
    out = _response_rows(values, offsets, resp_lens, width, "tensor")
    past = torch.arange(width, device=values.device).unsqueeze(0) >= resp_lens.unsqueeze(1)  # (B, W)
    return out.masked_fill_(past.view(*past.shape, *([1] * (values.dim() - 1))), 0)


def response_from_nested(tensor: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The response part of per-token outputs, nested ``(B, r_i, *)``."""
    layout = SequenceLayout.of(tensor, "tensor")
    responses = SequenceLayout.of(response_mask, "response_mask")
    rows = _response_rows(layout.values, layout.offsets, responses.lengths, responses.max_seq_len, "tensor")
    return nested_from_values(padded_to_jagged(rows, responses.offsets, responses.total_nnz), responses, "tensor")


def response_to_nested(tensor: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A right-padded ``(B, R, *)`` response tensor as nested ``(B, r_i, *)``."""
    responses = SequenceLayout.of(response_mask, "response_mask")
    if tensor.is_nested or tensor.dim() < 2 or tensor.shape[0] != responses.batch_size:
        raise ShapeError(f"'tensor' must be dense (B={responses.batch_size}, R, *), got "
                         f"{'nested ' if tensor.is_nested else ''}shape {tuple(tensor.shape)}")
    width = tensor.shape[1]
    if responses.max_seq_len > width:
        raise ShapeError(f"'tensor' has {width} response columns (shape {tuple(tensor.shape)}) but the "
                         f"longest response has {responses.max_seq_len} tokens")
    values = padded_to_jagged(tensor, responses.offsets.to(tensor.device), responses.total_nnz)
    return nested_from_values(values, responses, "tensor")


def _dense(data: TensorDictBase, key: str, dims: tuple[int, ...]) -> torch.Tensor:
    if key not in data.keys():
        raise KeyError(f"left_right_2_no_padding needs {key!r}; keys: {sorted(data.keys())}")
    value = data.get(key)
    if not isinstance(value, torch.Tensor) or value.is_nested or value.dim() not in dims:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) and not value.is_nested else "nested"
        raise ShapeError(f"{key!r} must be a dense tensor with {' or '.join(map(str, dims))} dims, got {shape}")
    return value


def _runs(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Flat indices of the runs ``[starts[i], starts[i] + lengths[i])``, back to back."""
    before = lengths.cumsum(0) - lengths
    shift = torch.repeat_interleave(starts - before, lengths, output_size=total)
    return torch.arange(total, device=starts.device) + shift


def left_right_2_no_padding(data: TensorDictBase) -> TensorDictBase:
    """A dense left-right padded batch as a new TensorDict of nested tensors; ``data`` is untouched.

    Reads ``input_ids`` ``(B, S)``, ``attention_mask`` ``(B, S)``, ``response_mask`` ``(B, R)``,
    ``position_ids`` ``(B, S)`` or ``(B, C, S)``, and optional ``teacher_ids``/``teacher_logprobs``
    ``(B, S, K)``. The prompt occupies the first ``S - R`` columns, left-padded; the response
    the last ``R``, right-padded. Returns nested ``input_ids``, ``position_ids``, ``prompts``,
    ``responses``, ``response_mask``, ``loss_mask`` (and teacher tensors), plus the flags
    ``max_seq_len`` and ``max_response_len``; every other key is carried over unchanged.
    """
    input_ids = _dense(data, "input_ids", (2,))
    attention_mask = _dense(data, "attention_mask", (2,))
    response_mask = _dense(data, "response_mask", (2,))
    position_ids = _dense(data, "position_ids", (2, 3))
    batch, seq = input_ids.shape
    width = response_mask.shape[1]
    for key, value in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if value.shape[0] != batch or value.shape[-1] != seq:
            raise BatchMismatchError(f"{key!r} has shape {tuple(value.shape)}, input_ids has {(batch, seq)}")
    if response_mask.shape[0] != batch or not 0 < width < seq:
        raise BatchMismatchError(f"'response_mask' has shape {tuple(response_mask.shape)}, input_ids has "
                                 f"{(batch, seq)}; need 0 < R < S")
    mask = attention_mask.bool()
    prompt_width = seq - width
    prompt_lens, resp_lens = mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1)
    lo_prompt, lo_resp, n_prompt, n_resp = torch.stack(
        [prompt_lens.min(), resp_lens.min(), prompt_lens.sum(), resp_lens.sum()]).tolist()
    if lo_prompt < 1 or lo_resp < 1:
        raise ShapeError("every row needs >= 1 prompt and >= 1 response token under 'attention_mask'; "
                         f"shortest prompt {lo_prompt}, shortest response {lo_resp}")
    # Row i's valid tokens must be the columns [P - p_i, P + r_i): left-padded prompt columns,
    # right-padded response columns. All of those set, and no others (the counts match), is exactly that.
    row_base = torch.arange(batch, device=mask.device) * seq
    first = row_base + prompt_width - prompt_lens
    seq_lens = prompt_lens + resp_lens
    index = _runs(first, seq_lens, n_prompt + n_resp)
    resp_index = _runs(row_base + prompt_width, resp_lens, n_resp)
    resp_mask_index = _runs(torch.arange(batch, device=mask.device) * width, resp_lens, n_resp)
    contiguous, stray = torch.stack([
        mask.reshape(-1).index_select(0, index).all(),
        (response_mask.bool() & ~mask[:, prompt_width:]).any()]).tolist()
    if not contiguous:
        raise ShapeError("'attention_mask' must be left-padded over the prompt columns and right-padded "
                         f"over the last {width} response columns")
    if stray:
        raise ShapeError("'response_mask' marks tokens that 'attention_mask' marks as padding")

    def nested(flat: torch.Tensor, lengths: torch.Tensor, jagged_dim: int = 1) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(flat, torch.nn.functional.pad(lengths.cumsum(0), (1, 0)),
                                                      jagged_dim=jagged_dim)

    def tokens(values: torch.Tensor, at: torch.Tensor = index, *, channels_first: bool = False) -> torch.Tensor:
        """The tokens at flat (B * S) indices ``at`` of ``(B, S, *)``, or of mRoPE ``(B, C, S)`` as ``(C, n)``."""
        if channels_first:
            return values.transpose(0, 1).reshape(values.shape[1], -1).index_select(1, at)
        return values.reshape(-1, *values.shape[2:]).index_select(0, at)

    out = data.copy()
    out.set("input_ids", nested(tokens(input_ids), seq_lens))
    mrope = position_ids.dim() == 3
    out.set("position_ids", nested(tokens(position_ids, channels_first=mrope), seq_lens, jagged_dim=2 if mrope else 1))
    out.set("prompts", nested(tokens(input_ids, _runs(first, prompt_lens, n_prompt)), prompt_lens))
    out.set("responses", nested(tokens(input_ids, resp_index), resp_lens))
    loss_mask = nested(response_mask.reshape(-1).index_select(0, resp_mask_index), resp_lens)
    out.set("response_mask", loss_mask)
    out.set("loss_mask", loss_mask)
    for key in ("teacher_ids", "teacher_logprobs"):
        if key in data.keys():
            teacher = _dense(data, key, (3,))
            if teacher.shape[:2] != (batch, seq):
                raise BatchMismatchError(f"{key!r} has shape {tuple(teacher.shape)}, expected ({batch}, {seq}, K)")
            out.set(key, nested(tokens(teacher), seq_lens))
    out.set_non_tensor("max_seq_len", seq)
    out.set_non_tensor("max_response_len", width)
    return out
