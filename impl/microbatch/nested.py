"""Jagged nested tensors of the micro-batch layer: build, gather rows, concatenate.

Every tensor built here is *canonical*: ``torch.nested`` jagged layout, ragged at the
dimension the caller asked for (``_ragged_idx``), the values ragged along axis
``_ragged_idx - 1``, ``offsets`` an int64 ``(B + 1,)`` vector on the values' device, and the
min / max sequence lengths cached, so ``to_padded_tensor()`` pads to the true longest row
whatever the ragged dimension (verl #7586). Rows are gathered with one index computation
per call (no Python loop over the rows).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

from ..errors import BatchMismatchError, NestedLayoutError, ShapeError
from ..layout import is_nested

__all__ = ["nested_tensor_from_tensor_list", "concat_nested_tensors", "jagged", "ragged_idx_of", "take_rows",
           "RowIndex", "token_index", "chunk_ranges"]

try:  # the jagged layout's Python class: built directly, no dispatch through _nested_view_from_jagged
    from torch.nested._internal.nested_tensor import NestedTensor as _JaggedTensor
except ImportError:  # pragma: no cover - a torch without the jagged layout's Python class
    _JaggedTensor = None

try:  # torch >= 2.5 caches the min / max lengths as tensors of shape (n, 0) (dynamic shapes under dynamo)
    from torch.nested._internal.nested_tensor import _store_val_in_tensor as _seqlen_cached
except ImportError:  # torch 2.4 (the floor): the cache holds the plain ints (what its own _max_seqlen computes)
    _seqlen_cached = int

#: the public factory takes min_seqlen / max_seqlen (torch >= 2.5; torch 2.4 has values, offsets, lengths, jagged_dim)
FACTORY_TAKES_SEQLENS = {"min_seqlen", "max_seqlen"} <= set(
    inspect.signature(torch.nested.nested_tensor_from_jagged).parameters)


def _cache_seqlens(out: torch.Tensor, min_seqlen: int, max_seqlen: int) -> torch.Tensor:
    """``out`` with its min / max lengths cached, in the form this torch keeps them."""
    out._metadata_cache["max_seqlen"] = _seqlen_cached(max_seqlen)
    out._metadata_cache["min_seqlen"] = _seqlen_cached(min_seqlen)
    return out


def jagged(values: torch.Tensor, offsets: torch.Tensor, ragged_idx: int, lengths: torch.Tensor | None = None,
           *, min_seqlen: int | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """A canonical jagged tensor over ``values`` (ragged along axis ``ragged_idx - 1``) with ``offsets``.

    ``min_seqlen`` / ``max_seqlen`` are cached on the tensor (computed from ``lengths`` or the
    offsets when not given): ``to_padded_tensor()`` then pads to the longest row.
    """
    if offsets.dtype != torch.int64 or offsets.device != values.device:
        offsets = offsets.to(device=values.device, dtype=torch.int64)
    if min_seqlen is None or max_seqlen is None:
        lens = offsets.diff() if lengths is None else lengths
        if lens.numel():
            min_seqlen, max_seqlen = (int(x) for x in torch.stack(lens.aminmax()).tolist())
        else:
            min_seqlen = max_seqlen = 0
    compiling = torch.compiler.is_compiling()
    if _JaggedTensor is None or values.requires_grad or compiling:
        if FACTORY_TAKES_SEQLENS:
            return torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_idx,
                                                          min_seqlen=min_seqlen, max_seqlen=max_seqlen)
        out = torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=ragged_idx)
        # torch 2.4: cached on the tensor as its own factory does (under dynamo it computes them when asked)
        return out if compiling else _cache_seqlens(out, min_seqlen, max_seqlen)
    # cached after construction: given to the constructor, torch marks them dynamic for dynamo (~200 us)
    return _cache_seqlens(_JaggedTensor(values, offsets, _ragged_idx=ragged_idx), min_seqlen, max_seqlen)


def ragged_idx_of(tensor: torch.Tensor) -> int:
    """The ragged dimension of a jagged tensor (verl's ``getattr(t, '_ragged_idx', t.dim() - 1)``)."""
    return int(getattr(tensor, "_ragged_idx", tensor.dim() - 1))


def _parts(tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(values, offsets, ragged_idx)`` of a jagged tensor without holes, checked."""
    if not is_nested(tensor):
        raise NestedLayoutError(f"{key!r} must be a jagged nested tensor, got a dense tensor of shape "
                                f"{tuple(tensor.shape)}")
    if tensor.layout != torch.jagged:
        raise NestedLayoutError(f"{key!r} must use layout=torch.jagged, got {tensor.layout}")
    if getattr(tensor, "_lengths", None) is not None:
        raise NestedLayoutError(f"{key!r} is a jagged tensor with holes (offsets and lengths); "
                                "call .contiguous() first")
    values = getattr(tensor, "_values", None)
    offsets = getattr(tensor, "_offsets", None)
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        values, offsets = tensor.values(), tensor.offsets()
    ragged = ragged_idx_of(tensor)
    axis = ragged - 1
    if not 0 <= axis < values.dim():
        raise NestedLayoutError(f"{key!r}: ragged dim {ragged} but values have shape {tuple(values.shape)}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise NestedLayoutError(f"{key!r} has malformed offsets of shape {tuple(offsets.shape)}")
    return values, offsets, ragged


def _check_offsets(values: torch.Tensor, offsets: torch.Tensor, ragged: int, key: str) -> None:
    """The offsets must run from 0 to the values' size along the ragged axis (verl #7899's misread layout fails here)."""
    ends = offsets[:: max(offsets.numel() - 1, 1)].tolist()
    stored = values.shape[ragged - 1]
    if ends[0] != 0 or ends[-1] != stored:
        raise NestedLayoutError(
            f"{key!r}: offsets run from {ends[0]} to {ends[-1]} but the values hold {stored} entries along the "
            f"ragged axis {ragged - 1} (values shape {tuple(values.shape)}, ragged dim {ragged}); a 3-D tensor "
            "built by torch.nested.as_nested_tensor from equal-length samples is ragged at the wrong dim: "
            "see impl.microbatch.maybe_fix_3d_position_ids")


def nested_tensor_from_tensor_list(tensors: Sequence[torch.Tensor], ragged_idx: int | None = None) -> torch.Tensor:
    """verl's ``nested_tensor_from_tensor_list``: one jagged row per sample tensor.

    ``ragged_idx`` (default: the samples' last dim, as verl) is the nested tensor's ragged
    dimension, 1-based (sample dim ``ragged_idx - 1``). Unlike verl, the result always has
    that layout and its min / max lengths cached, for equal lengths and B = 1 too.
    """
    if len(tensors) == 0:
        raise ShapeError("nested_tensor_from_tensor_list needs at least one tensor, got an empty list")
    first = tensors[0]
    if not isinstance(first, torch.Tensor) or first.dim() < 1:
        raise ShapeError(f"nested_tensor_from_tensor_list needs tensors of >= 1 dim, got "
                         f"{type(first).__name__} {tuple(getattr(first, 'shape', ()))}")
    sample_dim = first.dim()
    ragged = sample_dim if ragged_idx is None else int(ragged_idx)
    if not 1 <= ragged <= sample_dim:
        raise ShapeError(f"ragged_idx must be in [1, {sample_dim}] for samples of shape {tuple(first.shape)}, "
                         f"got {ragged}")
    axis = ragged - 1
    rest = tuple(s for d, s in enumerate(first.shape) if d != axis)
    lens = []
    for i, t in enumerate(tensors):  # shapes only (host metadata), no data is touched
        shape = tuple(t.shape)
        if len(shape) != sample_dim or tuple(s for d, s in enumerate(shape) if d != axis) != rest:
            raise ShapeError(f"sample {i} has shape {shape}; sample 0 has {tuple(first.shape)} "
                             f"(only dim {axis} may differ)")
        lens.append(shape[axis])
    values = torch.cat(list(tensors), dim=axis)
    lengths = torch.tensor(lens, dtype=torch.int64, device=values.device)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    return jagged(values, offsets, ragged, min_seqlen=min(lens), max_seqlen=max(lens))


#: tokens gathered per block: bounds the index (and temporary) of one gather to a few MiB
BLOCK_TOKENS = 1 << 20


def token_index(starts: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor, total: int,
                dtype: torch.dtype) -> torch.Tensor:
    """``(total,)``: ``starts[r] + (t - offsets[r])`` for each entry ``t`` of row ``r``, rows back to back.

    One tensor, no per-token temporaries: ones, plus at each row's first entry the jump from
    the previous row's end to its start (``index_add_``: empty rows telescope), then an
    in-place cumulative sum.
    """
    out = torch.ones(total, dtype=dtype, device=starts.device)
    if total == 0:
        return out
    ends = starts + lengths
    jumps = starts - torch.nn.functional.pad(ends[:-1], (1, 0))
    jumps[0] -= 1  # entry 0 holds starts[0]
    at = offsets[:-1]
    keep = at < total  # trailing empty rows start past the end
    out.index_add_(0, at[keep], jumps[keep].to(dtype))
    return out.cumsum_(0)


class RowIndex:
    """Where the rows ``indices`` of a jagged batch with ``offsets`` lie: computed once, used by every key.

    ``offsets`` are the selection's; :meth:`apply` gathers a key's values block by block
    (``BLOCK_TOKENS`` at a time), so the index never holds more than one block.
    """

    def __init__(self, offsets: torch.Tensor, indices: torch.Tensor):
        self.starts = offsets[:-1].index_select(0, indices)
        self.lengths = offsets[1:].index_select(0, indices) - self.starts
        self.offsets = torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0))
        if indices.numel():
            total, lo, hi = torch.cat([self.offsets[-1:], torch.stack(self.lengths.aminmax())]).tolist()
        else:
            total = lo = hi = 0
        self.total, self.min_seqlen, self.max_seqlen = int(total), int(lo), int(hi)
        self.dtype = torch.int32 if int(offsets[-1]) < 2**31 - 1 else torch.int64
        self._index: torch.Tensor | None = None
        if self.total <= BLOCK_TOKENS:
            self.blocks = [(0, indices.numel())]
        else:  # row blocks of about BLOCK_TOKENS tokens (a row is never split)
            marks = torch.arange(BLOCK_TOKENS, self.total, BLOCK_TOKENS, device=self.offsets.device)
            cuts = torch.searchsorted(self.offsets, marks).unique().tolist()
            edges = [0, *[c for c in cuts if 0 < c < indices.numel()], indices.numel()]
            self.blocks = list(zip(edges[:-1], edges[1:]))

    def apply(self, values: torch.Tensor, ragged: int) -> torch.Tensor:
        axis = ragged - 1
        device = values.device
        if len(self.blocks) == 1:
            if self._index is None or self._index.device != device:  # one index for every key of the group
                self._index = token_index(self.starts, self.lengths, self.offsets, self.total, self.dtype).to(device)
            out = values.index_select(axis, self._index)
        else:
            shape = list(values.shape)
            shape[axis] = self.total
            out = values.new_empty(shape)
            for r0, r1 in self.blocks:
                t0, t1 = (int(x) for x in self.offsets[[r0, r1]].tolist())
                index = token_index(self.starts[r0:r1], self.lengths[r0:r1], self.offsets[r0:r1 + 1] - t0, t1 - t0,
                                    self.dtype).to(device)
                out.narrow(axis, t0, t1 - t0).copy_(values.index_select(axis, index))
        return jagged(out, self.offsets.to(device), ragged, min_seqlen=self.min_seqlen, max_seqlen=self.max_seqlen)


def take_rows(tensor: torch.Tensor, indices: torch.Tensor, key: str, index: RowIndex | None = None) -> torch.Tensor:
    """The rows ``indices`` of a jagged tensor, in that order, as a new canonical jagged tensor (a copy)."""
    values, offsets, ragged = _parts(tensor, key)
    if index is None:
        _check_offsets(values, offsets, ragged, key)
        index = RowIndex(offsets.to(torch.int64), indices.to(offsets.device))
    return index.apply(values, ragged)


def chunk_ranges(tensor: torch.Tensor, chunks: int, key: str) -> list[torch.Tensor]:
    """``chunks`` equal consecutive row ranges of a jagged tensor (one host read for all of them).

    Each part's values are a view where the ragged axis is the leading one; where it is not
    (mRoPE positions ``(C, total)``) the slice would not be contiguous and is copied (verl's
    ``concat_nested_tensors`` requires contiguous input).
    """
    values, offsets, ragged = _parts(tensor, key)
    offsets = offsets.to(torch.int64)
    rows = offsets.numel() - 1
    step = rows // chunks
    lengths = offsets.diff().view(chunks, step)
    lo, hi = lengths.aminmax(dim=1)
    bounds, lows, highs = offsets[::step].tolist(), lo.tolist(), hi.tolist()
    axis = ragged - 1
    parts = []
    for i in range(chunks):  # a loop over micro-batches
        a, b = bounds[i], bounds[i + 1]
        part = values.narrow(axis, a, b - a)
        if not part.is_contiguous():
            part = part.contiguous()
        parts.append(jagged(part, offsets[i * step:(i + 1) * step + 1] - a, ragged, min_seqlen=lows[i],
                            max_seqlen=highs[i]))
    return parts


def concat_nested_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """verl's ``concat_nested_tensors``: the rows of every jagged tensor, back to back (one ``cat``)."""
    if len(tensors) == 0:
        raise ShapeError("concat_nested_tensors needs at least one nested tensor, got an empty list")
    parts = [_parts(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    ragged = parts[0][2]
    rest = [s for d, s in enumerate(parts[0][0].shape) if d != ragged - 1]
    for i, (values, offsets, r) in enumerate(parts):
        if tensors[i].dim() < 2:
            raise ShapeError(f"tensors[{i}]: nested tensor must have 2 or more dimensions, got {tuple(tensors[i].shape)}")
        if r != ragged or [s for d, s in enumerate(values.shape) if d != r - 1] != rest:
            raise BatchMismatchError(
                f"tensors[{i}] is ragged at dim {r} with values {tuple(values.shape)}; tensors[0] is ragged at dim "
                f"{ragged} with values {tuple(parts[0][0].shape)}")
    values = torch.cat([p[0] for p in parts], dim=ragged - 1)
    device = values.device
    lengths = torch.cat([p[1].to(device=device, dtype=torch.int64).diff() for p in parts])
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    if offsets[-1:].item() != values.shape[ragged - 1]:
        raise NestedLayoutError(f"the offsets sum to {offsets[-1:].item()} entries but the values hold "
                                f"{values.shape[ragged - 1]} along the ragged axis")
    return jagged(values, offsets, ragged, lengths)
