"""Pickling that also works for torch 2.4's jagged tensors: what crosses a process boundary (the real-rank
workers' tasks and replies, :mod:`spec.execute.rank_worker`) and what a reproducer saves beside itself
(``torch.save`` of its micro-batch, :mod:`spec.repro`).

torch drops a jagged tensor's cached size capsules when it is pickled (torch >= 2.5); 2.4 does not, and a jagged
tensor whose shape was read cannot be pickled there ("cannot pickle 'PyCapsule' object"). Such a tensor is saved
as its parts (values, offsets, lengths, ragged dim, cached lengths) and rebuilt by torch's own jagged class, so a
file saved this way loads with plain ``torch.load`` in a process that has no spec.

Across the process boundary (:func:`dumps`, not :func:`save`) a CPU storage travels as its raw bytes and dtype
(:func:`_cpu_storage` rebuilds it): pickle's own reduction writes each storage through a ``torch.save`` of its own
(about 0.1 ms to write and 0.08 ms to read a small one; a real-rank reply holds dozens). Each tensor keeps its
dtype, shape, strides, offset and ``requires_grad`` (the tensor's own reduction, unchanged); as with plain pickle,
two tensors that shared a storage in the sender get a storage each.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

try:  # the jagged layout's Python class (torch >= 2.4)
    from torch.nested._internal.nested_tensor import NestedTensor as _JaggedTensor
except ImportError:  # pragma: no cover
    _JaggedTensor = None

__all__ = ["dumps", "save"]

#: whether torch pickles a jagged tensor whose shape was read (torch >= 2.5 clears the cached capsules first)
_PICKLES_JAGGED = _JaggedTensor is None or hasattr(_JaggedTensor, "_clear_non_serializable_cached_data")


def _cpu_storage(data: bytearray, dtype: torch.dtype) -> Any:
    """A CPU ``TypedStorage`` of ``dtype`` over ``data`` (its raw bytes, the receiver's own unpickled copy, shared
    without another copy): what :class:`_Pickler` ships."""
    raw = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if data else torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)


def _storage_bytes(storage: Any) -> bytearray:
    """A copy of the raw bytes of a CPU ``TypedStorage`` (mutable, so the receiver's storage can share it)."""
    raw = storage._untyped_storage
    return bytearray(torch.empty(0, dtype=torch.uint8).set_(raw).numpy()) if raw.nbytes() else bytearray()


class _Pickler(pickle.Pickler):
    """pickle, with torch 2.4's jagged tensors rebuilt from their parts: values, offsets, lengths, ragged dim and
    cached lengths (torch 2.4's own reduction also carries the cached ``PyCapsule``, which does not pickle, and
    rebuilds the size ragged at dim 1 whatever the tensor's ragged dim). The rebuild is torch's class with its
    keywords bound (a ``functools.partial``), so unpickling needs torch only. With ``raw_storages`` (the process
    boundary, where both sides have spec) a CPU storage is written as its bytes (:func:`_cpu_storage`)."""

    raw_storages = False

    def reducer_override(self, obj: Any) -> Any:
        if self.raw_storages and type(obj) is torch.storage.TypedStorage and obj._untyped_storage.device.type == "cpu":
            return _cpu_storage, (_storage_bytes(obj), obj.dtype)
        if _PICKLES_JAGGED or type(obj) is not _JaggedTensor:
            return NotImplemented
        rebuild = functools.partial(_JaggedTensor, lengths=obj._lengths, _ragged_idx=obj._ragged_idx,
                                    _metadata_cache=dict(obj._metadata_cache))
        return rebuild, (obj._values, obj._offsets)


class _BoundaryPickler(_Pickler):
    raw_storages = True


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)`` for the other process of a real-rank run: also on torch 2.4 for jagged tensors whose
    shape was read, CPU storages as their raw bytes (see :class:`_Pickler`)."""
    buffer = io.BytesIO()
    _BoundaryPickler(buffer, 5).dump(obj)  # protocol 5: a bytearray is one opcode (4 rebuilds it from bytes)
    return buffer.getvalue()


def save(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)``, also on torch 2.4 for jagged tensors whose shape was read; ``torch.load(path,
    weights_only=False)`` reads it back without spec."""
    if _PICKLES_JAGGED:
        torch.save(obj, path)
    else:
        torch.save(obj, path, pickle_module=SimpleNamespace(Pickler=_Pickler, __name__="pickle"))
