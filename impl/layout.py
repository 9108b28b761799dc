"""Jagged-layout checks and the index arithmetic every other module shares.

A micro-batch's geometry is read once into a :class:`SequenceLayout` (offsets,
lengths, batch size, ``total_nnz``, ``max_seq_len``) with a single host sync.
Every conversion between the packed row, the dense ``(B, L)`` batch and nested
tensors is an index computation here: no Python loop over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .dense import jagged_to_padded, repeat_rows, rows_and_positions
from .errors import BatchMismatchError, NestedLayoutError, ShapeError

__all__ = [
    "SequenceLayout",
    "jagged_parts",
    "require_jagged",
    "nested_from_values",
    "dense_from_jagged",
    "is_nested",
    "make_jagged",
]

try:  # torch's Python class of jagged nested tensors: exact-type checks skip __torch_function__
    from torch.nested._internal.nested_tensor import NestedTensor as _JaggedTensor
except ImportError:  # pragma: no cover - a torch without the jagged layout's Python class
    _JaggedTensor = None


def is_nested(tensor: object) -> bool:
    """``tensor.is_nested``, without ``__torch_function__`` (~7 us a call) for jagged tensors."""
    return (_JaggedTensor is not None and type(tensor) is _JaggedTensor) or (
        isinstance(tensor, torch.Tensor) and tensor.is_nested)


def make_jagged(values: torch.Tensor, offsets: torch.Tensor, jagged_dim: int = 1) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=jagged_dim)``, made directly.

    The public function routes through ``torch._nested_view_from_jagged`` and the nested
    tensor's ``__torch_dispatch__`` (~45 us of Python per call, most of a small batch's time)
    to record the autograd view; where no gradient can flow (``values`` does not require
    grad) and nothing traces, the very same object is built by the class's constructor:
    same values tensor, offsets and ragged size.
    """
    if (_JaggedTensor is None or jagged_dim < 1 or values.requires_grad or offsets.dim() != 1
            or values.device != offsets.device or torch.compiler.is_compiling()):
        return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=jagged_dim)
    return _JaggedTensor(values, offsets, _ragged_idx=jagged_dim)


def require_jagged(tensor: object, key: str, *, ragged_dim: int = 1) -> torch.Tensor:
    """``tensor`` if it is a jagged nested tensor ragged at ``ragged_dim``, else raise."""
    if _JaggedTensor is not None and type(tensor) is _JaggedTensor and tensor._ragged_idx == ragged_dim:
        return tensor  # the common case, checked without __torch_function__
    if not isinstance(tensor, torch.Tensor):
        raise NestedLayoutError(f"{key!r} must be a jagged nested tensor, got {type(tensor).__name__}")
    if not tensor.is_nested:
        raise NestedLayoutError(
            f"{key!r} must be a jagged nested tensor (torch.nested, layout=torch.jagged), "
            f"got a dense tensor of shape {tuple(tensor.shape)}")
    if tensor.layout != torch.jagged:
        raise NestedLayoutError(f"{key!r} must use layout=torch.jagged, got {tensor.layout}")
    actual = getattr(tensor, "_ragged_idx", 1)
    if actual != ragged_dim:
        raise NestedLayoutError(
            f"{key!r} has shape {tuple(tensor.shape)} ragged at dim {actual}; expected the ragged "
            f"dimension at dim {ragged_dim} (build 3-D position ids with "
            "nested_tensor_from_jagged(values, offsets, jagged_dim=2))")
    return tensor


def jagged_parts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, offsets)`` of a checked jagged tensor.

    Reads the attributes directly where torch has them: the public accessors go through
    ``__torch_function__`` and cost tens of microseconds each, which dominates small batches.
    """
    values, offsets = getattr(tensor, "_values", None), getattr(tensor, "_offsets", None)
    if isinstance(values, torch.Tensor) and isinstance(offsets, torch.Tensor):
        return values, offsets
    return tensor.values(), tensor.offsets()


@dataclass(frozen=True)
class SequenceLayout:
    """Geometry of one jagged batch: where each sequence starts and how long it is."""

    offsets: torch.Tensor  # (B + 1,) int64, on the values' device
    values: torch.Tensor  # the packed values the layout was read from
    batch_size: int
    total_nnz: int
    max_seq_len: int
    min_seq_len: int

    @classmethod
    def of(cls, tensor: torch.Tensor, key: str, *, ragged_dim: int = 1,
           like: "SequenceLayout | None" = None) -> "SequenceLayout":
        """Read and check the layout of the jagged tensor stored under ``key``.

        With ``like`` (another batch's layout): when the offsets equal ``like``'s, its
        numbers are reused (one ``torch.equal``, no host sync for them).
        """
        tensor = require_jagged(tensor, key, ragged_dim=ragged_dim)
        values, offsets = jagged_parts(tensor)
        if offsets.dtype != torch.int64 or offsets.device != values.device:
            offsets = offsets.to(device=values.device, dtype=torch.int64)
        stored = values.shape[ragged_dim - 1]
        if like is not None and (offsets is like.offsets or (
                offsets.shape == like.offsets.shape and torch.equal(offsets, like.offsets))):
            if stored != like.total_nnz:
                raise NestedLayoutError(
                    f"{key!r}: offsets end at {like.total_nnz} but values hold {stored} tokens "
                    f"(values shape {tuple(values.shape)})")
            layout = cls(offsets=offsets, values=values, batch_size=like.batch_size, total_nnz=like.total_nnz,
                         max_seq_len=like.max_seq_len, min_seq_len=like.min_seq_len)
            layout.__dict__["lengths"] = like.lengths
            return layout
        batch_size = offsets.numel() - 1
        if batch_size < 1:
            raise ShapeError(f"{key!r} is an empty batch (offsets {offsets.tolist()})")
        lengths = offsets.diff()
        # Both ends (offsets[::B] is a view), min and max length: two tiny reads on the CPU, where
        # they are cheaper than one stacked read; one host sync on an accelerator.
        if offsets.device.type == "cpu":
            (first, last), (lo, hi) = offsets[::batch_size].tolist(), torch.stack(lengths.aminmax()).tolist()
        else:
            first, last, lo, hi = torch.cat([offsets[::batch_size], torch.stack(lengths.aminmax())]).tolist()
        if first != 0 or lo < 0:
            raise NestedLayoutError(f"{key!r} has malformed offsets: must start at 0 and not decrease")
        if last != stored:
            raise NestedLayoutError(
                f"{key!r}: offsets end at {last} but values hold {stored} tokens "
                f"(values shape {tuple(values.shape)})")
        layout = cls(offsets=offsets, values=values, batch_size=batch_size, total_nnz=last, max_seq_len=hi,
                     min_seq_len=lo)
        layout.__dict__["lengths"] = lengths  # the cached property, computed once
        return layout

    @cached_property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` int64 sequence lengths."""
        return self.offsets.diff()

    def per_token(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``(total_nnz, *)``: each sample's value repeated over its tokens."""
        return repeat_rows(per_sample, self.lengths.to(per_sample.device), self.total_nnz)

    @cached_property
    def dense_index(self) -> torch.Tensor:
        """``(total_nnz,)``: each packed token's flat index in a ``(B, max_seq_len)`` batch."""
        rows, positions = rows_and_positions(self.offsets, self.total_nnz)
        return rows * self.max_seq_len + positions

    def expect_same_lengths(self, other: "SequenceLayout", key: str) -> None:
        """Raise unless ``other`` (read from ``key``) has the same sequences' lengths."""
        if other.batch_size != self.batch_size:
            raise BatchMismatchError(
                f"{key!r} has batch size {other.batch_size}, input_ids has {self.batch_size}")
        if not torch.equal(other.offsets, self.offsets):
            raise BatchMismatchError(
                f"{key!r} sequence lengths {other.lengths.tolist()} differ from input_ids "
                f"lengths {self.lengths.tolist()}")

    def mask(self, max_seq_len: int | None = None) -> torch.Tensor:
        """``(B, L)`` int32: 1 where ``t < n_i``."""
        width = self.max_seq_len if max_seq_len is None else int(max_seq_len)
        if width < self.max_seq_len:
            raise ShapeError(f"max_seq_len={width} is shorter than the longest sequence ({self.max_seq_len})")
        # Row i is the window [width - n_i, 2 * width - n_i) of a ``width`` ones + ``width`` zeros
        # template: one row gather (a contiguous copy per row from a tiny, cached source), where
        # a broadcast compare costs ~3.5x as much on the CPU.
        template = torch.zeros(2 * width, dtype=torch.int32, device=self.offsets.device)
        template[:width] = 1
        return template.unfold(0, width, 1).index_select(0, width - self.lengths)


def nested_from_values(values: torch.Tensor, layout: SequenceLayout, key: str) -> torch.Tensor:
    """A jagged nested tensor with ``layout``'s offsets over ``values`` (ragged along dim 0)."""
    if values.shape[0] != layout.total_nnz:
        raise ShapeError(
            f"{key!r} has {values.shape[0]} tokens (shape {tuple(values.shape)}), "
            f"the batch has total_nnz={layout.total_nnz}")
    return make_jagged(values, layout.offsets.to(values.device))


def dense_from_jagged(values: torch.Tensor, layout: SequenceLayout, pad_value: float | int,
                      *, token_dim: int = 0) -> torch.Tensor:
    """Right-pad packed ``values`` into a dense ``(B, max_seq_len, *rest)`` batch.

    With ``token_dim=1`` (values ``(C, total)``, e.g. mRoPE positions) the result is
    ``(C, B, max_seq_len)``.
    """
    if token_dim == 1:
        dense = jagged_to_padded(values.t(), layout.offsets, layout.max_seq_len, pad_value)  # (B, L, C)
        return dense.permute(2, 0, 1).contiguous()
    return jagged_to_padded(values, layout.offsets, layout.max_seq_len, pad_value)
