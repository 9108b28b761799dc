"""verl's nested-TensorDict utilities (``verl/utils/tensordict_utils.py``), vectorised and layout-preserving.

Every jagged key keeps its layout (2-D ids, 3-D mRoPE positions ``(B, 4, j)`` ragged at 2,
3-D routed experts ``(B, j, L, K)``, teacher top-K ``(B, j, K)``), for equal lengths and B = 1
too; dense tensors, ``NonTensorData`` flags and ``NonTensorStack`` per-sample items are
handled by the very tensordict calls verl makes. Inputs are never modified.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.tensorclass import NonTensorData, NonTensorStack

from ..errors import BatchMismatchError, NestedLayoutError, ShapeError
from ..layout import is_nested
from .nested import (RowIndex, _check_offsets, _parts, chunk_ranges, concat_nested_tensors, jagged,
                     nested_tensor_from_tensor_list)

__all__ = ["index_select_tensor_dict", "chunk_tensordict", "concat_tensordict", "list_of_dict_to_tensordict",
           "maybe_fix_3d_position_ids", "Selector"]


def _as_index(indices: torch.Tensor | Sequence[int], batch_size: int | None) -> torch.Tensor:
    """int64 ``(n,)`` indices in ``[0, batch_size)`` (negative ones counted from the end, as tensor indexing does;
    ``batch_size`` None: a batch of metadata only, with no rows to range-check against)."""
    index = indices if isinstance(indices, torch.Tensor) else torch.tensor(list(indices), dtype=torch.int64)
    if index.dim() != 1:
        raise ShapeError(f"indices must be a 1-D tensor or list, got shape {tuple(index.shape)}")
    if index.dtype == torch.bool or index.is_floating_point():
        raise ShapeError(f"indices must be integers, got dtype {index.dtype}")
    index = index.to(torch.int64)
    if index.numel() and batch_size is not None:
        lo, hi = torch.stack(index.aminmax()).tolist()
        if lo < -batch_size or hi >= batch_size:
            raise ShapeError(f"indices range over [{lo}, {hi}], outside a batch of size {batch_size}")
        if lo < 0:
            index = torch.where(index < 0, index + batch_size, index)
    return index


class Selector:
    """Row selections of one batch: its nested keys checked once, keys with equal offsets sharing one index."""

    def __init__(self, batch: TensorDictBase):
        self.items = list(batch.items())
        self.groups: list[tuple[torch.Tensor, list[str]]] = []  # (offsets, keys)
        self.parts: dict[str, tuple[torch.Tensor, int]] = {}
        for key, value in self.items:
            if not is_nested(value):
                continue
            values, offsets, ragged = _parts(value, key)
            _check_offsets(values, offsets, ragged, key)
            self.parts[key] = (values, ragged)
            for known, keys in self.groups:
                if known is offsets or (known.shape == offsets.shape and known.device == offsets.device
                                        and torch.equal(known, offsets)):
                    keys.append(key)
                    break
            else:
                self.groups.append((offsets, [key]))

    def select(self, index: torch.Tensor) -> TensorDict:
        """:func:`index_select_tensor_dict` for checked int64 indices."""
        if self.groups and index.numel() == 0:
            raise ShapeError(f"{self.groups[0][1][0]!r}: cannot select zero rows of a nested tensor")
        nested: dict[str, torch.Tensor] = {}
        for offsets, keys in self.groups:
            rows = RowIndex(offsets.to(torch.int64), index.to(offsets.device))
            for key in keys:
                nested[key] = rows.apply(*self.parts[key])
        data: dict[str, Any] = {}
        for key, value in self.items:
            if key in nested:
                data[key] = nested[key]
            elif isinstance(value, torch.Tensor):
                data[key] = value[index.to(value.device)]
            elif value.shape:  # NonTensorStack, nested TensorDicts: indexable along the batch
                data[key] = value[index]
            else:  # NonTensorData of a batch without a batch size: metadata, kept
                data[key] = value
        return TensorDict(source=data, batch_size=[index.shape[0]])


def index_select_tensor_dict(batch: TensorDictBase | None, indices: torch.Tensor | list[int]) -> TensorDict | None:
    """verl's ``index_select_tensor_dict``: a new TensorDict of the rows ``indices``, in that order.

    Jagged keys are gathered with one index per distinct offsets (no unbind); ``None`` in,
    ``None`` out, as verl; a TensorDict of metadata only (no batch size, no tensor) keeps every
    entry whole, as verl.
    """
    if batch is None:
        if isinstance(indices, torch.Tensor) and indices.dim() != 1:
            raise ShapeError(f"indices must be a 1-D tensor or list, got shape {tuple(indices.shape)}")
        return None
    size = batch.batch_size[0] if len(batch.batch_size) else _nested_batch_size(batch)
    return Selector(batch).select(_as_index(indices, size))


def _nested_batch_size(batch: TensorDictBase) -> int | None:
    """The rows of a TensorDict without a batch size: its first tensor's; None when it holds metadata only."""
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    if all(not getattr(value, "shape", ()) for _, value in batch.items()):
        return None
    raise ShapeError(f"cannot tell the batch size of a TensorDict with batch_size [] and keys {sorted(batch.keys())}")


def chunk_tensordict(td: TensorDictBase, chunks: int) -> list[TensorDict]:
    """verl's ``chunk_tensordict``: ``chunks`` equal consecutive parts.

    Dense keys, flags and stacks go through ``TensorDict.chunk`` as in verl (views); a
    jagged key's part is a view of its values with rebased offsets where the ragged axis is
    the leading one (ids, teacher top-K, routed experts), a copy otherwise (mRoPE positions):
    no unbind, no ``to_padded_tensor`` fallback, nothing truncated (verl #7586).
    """
    if not isinstance(td, TensorDictBase):
        raise ShapeError(f"chunk_tensordict needs a TensorDict, got {type(td).__name__}")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ShapeError(f"chunks must be a positive int, got {chunks!r}")
    size = len(td)
    if size % chunks:
        raise ShapeError(f"chunk_tensordict: a batch of {size} samples does not split into {chunks} equal chunks "
                         f"(batch_size {list(td.batch_size)})")
    nested_keys = [key for key, value in td.items() if is_nested(value)]
    for key in nested_keys:
        values, offsets, ragged = _parts(td.get(key), key)
        _check_offsets(values, offsets, ragged, key)
        if offsets.numel() - 1 != size:
            raise BatchMismatchError(f"{key!r} holds {offsets.numel() - 1} rows, the batch has {size}")
    rest = TensorDict({k: v for k, v in td.items() if k not in nested_keys}, batch_size=td.batch_size,
                      device=td.device)
    parts = rest.chunk(chunks=chunks)
    for key in nested_keys:
        for part, rows in zip(parts, chunk_ranges(td.get(key), chunks, key)):
            part[key] = rows
    return list(parts)


def concat_tensordict(data: Sequence[TensorDictBase]) -> TensorDict:
    """verl's ``concat_tensordict``: the TensorDicts' rows back to back (jagged keys with one ``cat``)."""
    if len(data) == 0:
        raise ShapeError("concat_tensordict needs at least one TensorDict, got an empty list")
    nested_keys = {key for key, value in data[0].items() if is_nested(value)}
    if not nested_keys:
        if len(data[0].batch_size) == 0:
            if any(len(d.batch_size) for d in data):
                raise BatchMismatchError("concat_tensordict: TensorDicts with and without a batch size: "
                                         f"{[list(d.batch_size) for d in data]}")
            return data[0]
        return TensorDict.cat(list(data), dim=0)
    regular = []
    for i, td in enumerate(data):
        keys = {key for key, value in td.items() if is_nested(value)}
        if keys != nested_keys:
            raise BatchMismatchError(f"data[{i}] has nested keys {sorted(keys)}, data[0] has {sorted(nested_keys)}")
        regular.append(TensorDict({k: v for k, v in td.items() if k not in nested_keys}, batch_size=td.batch_size,
                                  device=td.device))
    output = TensorDict.cat(regular, dim=0)
    for key in sorted(nested_keys):
        try:
            output[key] = concat_nested_tensors([td.get(key) for td in data])
        except (BatchMismatchError, ShapeError, NestedLayoutError) as exc:
            raise type(exc)(f"{key!r}: {exc}") from None
    return output


def _ragged_dim(key: str, shapes: list[tuple[int, ...]], override: int | None) -> int:
    """1-based ragged dim of a key's per-sample tensors: the one dim whose size differs, else the convention."""
    dims = len(shapes[0])
    if any(len(s) != dims for s in shapes):
        raise ShapeError(f"{key!r}: per-sample tensors of different ranks: {sorted(set(shapes))[:4]}")
    differ = [d for d in range(dims) if len({s[d] for s in shapes}) > 1]
    if override is not None:
        if not 1 <= override <= dims or any(d != override - 1 for d in differ):
            raise ShapeError(f"{key!r}: ragged dim {override} given, but samples of shapes {sorted(set(shapes))[:4]} "
                             f"differ in dims {[d + 1 for d in differ]}")
        return override
    if len(differ) > 1:
        raise ShapeError(f"{key!r}: per-sample tensors differ in more than one dim ({[d + 1 for d in differ]}): "
                         f"{sorted(set(shapes))[:4]}; a jagged tensor has one ragged dim")
    if differ:
        return differ[0] + 1
    # equal shapes (or one sample): the sequence dim by the layer's conventions: mRoPE positions
    # (C, j) are ragged last, everything else (ids (j,), top-K (j, K), experts (j, L, K)) first
    return dims if (key == "position_ids" and dims == 2) else 1


def list_of_dict_to_tensordict(list_of_dicts: Sequence[dict[str, Any]], *,
                               ragged_dims: dict[str, int] | None = None) -> TensorDict:
    """verl's ``list_of_dict_to_tensordict``: one sample per dict.

    A key whose values are all tensors of >= 1 dim becomes a jagged tensor *always* (verl
    stacks equal shapes into a dense tensor, so ``.offsets()`` fails when, say, every
    response hit the maximum length or there is one sample: verl #7661); 0-d tensors are
    stacked; anything else becomes a ``NonTensorStack``. The ragged dim is the one dim whose
    size differs; with equal shapes it is the sequence dim (``position_ids`` ``(C, j)``: the
    last; every other key: the first), or ``ragged_dims[key]`` (keyword-only; not in verl).
    """
    if len(list_of_dicts) == 0:
        raise ShapeError("list_of_dict_to_tensordict needs at least one dict, got an empty list")
    keys = list(list_of_dicts[0].keys())
    for i, d in enumerate(list_of_dicts):
        if set(d.keys()) != set(keys):
            raise BatchMismatchError(f"sample {i} has keys {sorted(d.keys())}, sample 0 has {sorted(keys)}")
    final: dict[str, Any] = {}
    for key in keys:
        items = [d[key] for d in list_of_dicts]
        if all(isinstance(x, torch.Tensor) for x in items):
            if all(x.dim() == 0 for x in items):
                final[key] = torch.stack(items)
                continue
            shapes = [tuple(x.shape) for x in items]
            ragged = _ragged_dim(key, shapes, (ragged_dims or {}).get(key))
            final[key] = nested_tensor_from_tensor_list(items, ragged_idx=ragged)
        else:
            final[key] = NonTensorStack(*items)
    return TensorDict(final, batch_size=[len(list_of_dicts)])


#: the channels of mRoPE position ids: 3 (Qwen2-VL's t, h, w) or 4 (verl's text row first). A ragged-at-1 reading
#: whose rows are not all one of these counts is not an equal-length batch: with values (4, 4) and offsets
#: [0, 2, 4] (two samples of 2 tokens whose ragged dim a pickle round trip lost, as tensordict 0.8.3's consolidate
#: on torch 2.4 leaves them) the rows would otherwise be read as 2 channels
MROPE_CHANNELS = (3, 4)


def maybe_fix_3d_position_ids(data: TensorDictBase) -> TensorDictBase:
    """verl's ``maybe_fix_3d_position_ids``: make 3-D nested ``position_ids`` ragged at dim 2, validated.

    verl sets ``_ragged_idx = 2`` on whatever 3-D nested tensor it finds; a batch of
    equal-length samples built by ``torch.nested.as_nested_tensor`` is ragged at dim 1
    (values ``(B * C, L)``, offsets ``C, 2C, ...``) and that blind fix makes it inconsistent
    (verl #7899). Here the canonical layout (values ``(C, total)``) is recognised and kept,
    the ragged-at-1 one is rebuilt, anything else raises. Like verl it sets the key on
    ``data`` (a new tensor; the old tensor object is not modified) and returns ``data``.
    """
    if "position_ids" not in data.keys():
        return data
    pos = data.get("position_ids")
    if not (isinstance(pos, torch.Tensor) and is_nested(pos) and pos.dim() == 3):
        return data
    values, offsets, ragged = _parts(pos, "position_ids")
    offsets = offsets.to(torch.int64)
    rows = offsets.numel() - 1
    first, last = (int(x) for x in offsets[[0, -1]].tolist())
    if values.dim() == 2 and first == 0:
        if ragged == 2 and last == values.shape[1]:
            return data  # canonical
        comps = offsets.diff()
        if (ragged == 1 and last == values.shape[0] and rows and int(comps[0]) in MROPE_CHANNELS
                and bool((comps == comps[0]).all())):
            # equal-length samples read as ragged at dim 1: values (B * C, L) -> (C, B * L)
            c, length = int(comps[0]), values.shape[1]
            fixed = values.reshape(rows, c, length).permute(1, 0, 2).reshape(c, rows * length)
            new_offsets = torch.arange(rows + 1, device=values.device, dtype=torch.int64) * length
            data["position_ids"] = jagged(fixed, new_offsets, 2, min_seqlen=length, max_seqlen=length)
            return data
        if last == values.shape[1]:  # values (C, total) that lost their ragged dim (a pickle round trip)
            data["position_ids"] = jagged(values, offsets, 2)
            return data
    raise NestedLayoutError(
        f"'position_ids' is a 3-D nested tensor of shape {tuple(pos.shape)} with values {tuple(values.shape)}, "
        f"ragged dim {ragged} and {rows} rows: neither the canonical (C, total) layout ragged at 2 nor an "
        "equal-length batch read as ragged at 1")
