"""A micro-batch's images and videos, handed to the model as verl hands them.

A trainer's micro-batch may carry ``multi_modal_inputs``: one entry per sample (a ``NonTensorStack`` of
``NonTensorData``, as verl's ``get_tensordict`` stores a list of dicts), each the dict a vision-language processor
returned for that sample (``pixel_values`` ``(patches, dim)`` and ``image_grid_thw`` ``(k, 3)``, the video keys
``pixel_values_videos``/``video_grid_thw``), or ``{}``/``None`` for a text-only sample. The model takes each key
concatenated over the samples in their order (its image tokens are in that order in the packed row and in the
padded rows alike), on the ids' device.

An audio model's processor (a Whisper feature extractor: Qwen2-Audio, Qwen2.5-Omni) returns ``input_features``
``(clips, mels, frames)`` and ``feature_attention_mask`` ``(clips, frames)`` padded to the sample's longest clip, so
samples' frame counts differ: those keys (verl's ``_VARLEN_MULTI_MODAL_KEYS``, with ``mm_token_type_ids``) are
padded with zeros on their last dimension to the longest sample's before they are concatenated (the mask's zeros
mark the padding frames, which the model does not read).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from .errors import BatchMismatchError, ShapeError

__all__ = ["MULTI_MODAL_KEY", "VARLEN_KEYS", "extract_multi_modal_inputs", "multi_modal_model_inputs"]

#: the micro-batch key of the per-sample media dicts
MULTI_MODAL_KEY = "multi_modal_inputs"
#: the keys whose last dimension differs between samples, padded with zeros to the longest (verl's)
VARLEN_KEYS = frozenset({"input_features", "feature_attention_mask", "mm_token_type_ids"})


def _entries(stack: Any) -> list[Any]:
    """The per-sample entries of a ``NonTensorStack`` (or a list), each unwrapped from its ``NonTensorData``."""
    items = stack.tolist() if hasattr(stack, "tolist") else list(stack)
    return [getattr(item, "data", item) for item in items]


def extract_multi_modal_inputs(batch_data: Sequence[Any], indices: Sequence[int] | None = None, *,
                               device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """verl's ``extract_multi_modal_inputs``: the entries (all, or ``indices`` in that order) concatenated per key
    along dim 0, a text-only sample's ``{}``/``None`` skipped, keys in the order they first appear; each tensor on
    ``device`` where given. An entry that is not a dict of tensors, or values of one key that do not concatenate,
    raise ``ShapeError`` naming the key, the sample and the shapes."""
    entries = _entries(batch_data)
    if indices is not None:
        entries = [entries[int(i)] for i in indices]
    dicts = [entry or {} for entry in entries]
    for i, entry in enumerate(dicts):
        if not isinstance(entry, dict) or not all(isinstance(v, torch.Tensor) or v is None for v in entry.values()):
            raise ShapeError(f"'{MULTI_MODAL_KEY}' of sample {i} must be a dict of tensors (or empty), got "
                             f"{type(entry).__name__}")
    keys = list(dict.fromkeys(key for entry in dicts for key, value in entry.items() if value is not None))
    out = {}
    for key in keys:
        values = [entry[key] for entry in dicts if entry.get(key) is not None]
        varlen = key in VARLEN_KEYS
        if len({v.dim() for v in values}) != 1 or varlen and values[0].dim() < 2 or \
                len({tuple(v.shape[1:v.dim() - varlen]) for v in values}) != 1:
            raise ShapeError(f"'{MULTI_MODAL_KEY}' key {key!r}: the samples' values do not concatenate along dim 0"
                             f"{' (their last dimension padded)' if varlen else ''}; shapes "
                             f"{[tuple(v.shape) for v in values]}")
        if varlen:
            width = max(v.shape[-1] for v in values)
            values = [torch.nn.functional.pad(v, (0, width - v.shape[-1])) for v in values]
        joined = torch.cat(values)
        out[key] = joined if device is None else joined.to(device)
    return out


def multi_modal_model_inputs(micro_batch: TensorDictBase, batch_size: int,
                             device: torch.device | str) -> dict[str, torch.Tensor]:
    """What the model takes of ``micro_batch``'s ``multi_modal_inputs`` (``{}`` without it): one entry per sample is
    required (``BatchMismatchError`` naming both counts otherwise)."""
    if MULTI_MODAL_KEY not in micro_batch.keys():
        return {}
    entries = _entries(micro_batch.get(MULTI_MODAL_KEY))
    if len(entries) != batch_size:
        raise BatchMismatchError(f"'{MULTI_MODAL_KEY}' holds {len(entries)} entries for a micro-batch of "
                                 f"{batch_size} sequences")
    return extract_multi_modal_inputs(entries, device=device)
