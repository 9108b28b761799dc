"""Fast conversions between jagged rows and dense padded batches.

Both use torch's jagged kernels where the installed torch has them for the tensor's
device (CPU kernels arrived after torch 2.4) and no gradient flows through them (the kernels have
no derivative: a critic trained through the padded path would fail in backward, found by INV-STEP-004);
otherwise an equivalent index-based path.
The choice is probed once per (device type, direction) and cached.
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["jagged_to_padded", "padded_to_jagged", "rows_and_positions", "repeat_rows"]


@lru_cache(maxsize=None)
def _has_kernel(device_type: str, name: str) -> bool:
    op = getattr(torch.ops.aten, name, None)
    if op is None:
        return False
    try:
        if name == "_jagged_to_padded_dense_forward":
            op(torch.zeros(2, 1, device=device_type), [torch.tensor([0, 1, 2], device=device_type)], [1], 0.0)
        else:
            op(torch.zeros(2, 1, 1, device=device_type), [torch.tensor([0, 1, 2], device=device_type)], 2)
    except (NotImplementedError, RuntimeError):
        return False
    return True


@lru_cache(maxsize=None)
def _has_segment_expand(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``_segment_reduce_backward`` (sum) expands per-segment values here, exactly."""
    op = getattr(torch.ops.aten, "_segment_reduce_backward", None)
    if op is None:
        return False
    try:
        per_sample = torch.tensor([1.5, -2.0], device=device_type).to(dtype)
        got = op(per_sample, per_sample, per_sample.new_empty(3), "sum", lengths=torch.tensor([1, 2], device=device_type),
                 axis=0)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return bool(torch.equal(got.cpu(), torch.tensor([1.5, -2.0, -2.0]).to(dtype)))


def repeat_rows(per_sample: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``(total,)``: ``per_sample[i]`` repeated ``lengths[i]`` times, back to back (1-D ``per_sample``).

    ``torch.repeat_interleave`` builds an int64 index of ``total`` entries and gathers
    through it (3x the output's bytes, in fresh pages); the backward of a segment sum is
    the same expansion written straight into the output, so it is used where torch has it
    for this device and dtype (probed once) and no gradient is wanted.
    """
    if (per_sample.dim() == 1 and not per_sample.requires_grad
            and _has_segment_expand(per_sample.device.type, per_sample.dtype)):
        return torch.ops.aten._segment_reduce_backward(per_sample, per_sample, per_sample.new_empty(total), "sum",
                                                       lengths=lengths, axis=0)
    return torch.repeat_interleave(per_sample, lengths, dim=0, output_size=total)


def rows_and_positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total,)`` each token's row and its position inside the row, for jagged ``offsets``."""
    rows = torch.repeat_interleave(torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff(),
                                   output_size=total)
    return rows, torch.arange(total, device=offsets.device) - offsets[:-1].index_select(0, rows)


def _backpropagated(tensor: torch.Tensor) -> bool:
    """Whether a loss will backpropagate through ``tensor``: the aten jagged kernels have no derivative (the index
    path has one), so a critic's values trained through the padded path take the index path."""
    return tensor.requires_grad and torch.is_grad_enabled()


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, width: int, pad_value: float | int) -> torch.Tensor:
    """``(B, width, *rest)``: row i holds ``values[offsets[i]:offsets[i+1]]`` cut to ``width``, then padding.

    ``offsets`` must start at 0 and end at ``values.shape[0]``.
    """
    batch, rest = offsets.numel() - 1, tuple(values.shape[1:])
    if _has_kernel(values.device.type, "_jagged_to_padded_dense_forward") and values.dtype != torch.bool \
            and not _backpropagated(values):
        flat = values.reshape(values.shape[0], -1)
        dense = torch.ops.aten._jagged_to_padded_dense_forward(flat, [offsets], [width], float(pad_value))
        return dense.view(batch, width, *rest)
    rows, pos = rows_and_positions(offsets, values.shape[0])
    keep = pos < width
    out = values.new_full((batch * width, *rest), pad_value)
    out.index_copy_(0, (rows * width + pos)[keep], values[keep])
    return out.view(batch, width, *rest)


def padded_to_jagged(dense: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    """``(total, *rest)``: the first ``offsets[i+1] - offsets[i]`` entries of each row of ``dense``."""
    if _has_kernel(dense.device.type, "_padded_dense_to_jagged_forward") and dense.dtype != torch.bool \
            and not _backpropagated(dense):
        rest = tuple(dense.shape[2:])
        flat = dense.reshape(dense.shape[0], dense.shape[1], -1)
        return torch.ops.aten._padded_dense_to_jagged_forward(flat, [offsets], total).view(total, *rest)
    rows, pos = rows_and_positions(offsets, total)
    flat = dense.reshape(dense.shape[0] * dense.shape[1], *dense.shape[2:])
    return flat.index_select(0, rows * dense.shape[1] + pos)
