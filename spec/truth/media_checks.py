"""The check of what a vision-language micro-batch hands the model, stated once (INV-MM-001): each sample's image and
video features and grids, concatenated in sample order, beside as many media tokens as their merged groups, and the
token marks some engines hand beside them. The invariant (spec/invariants/media.py) calls it on the suite's run; a
standalone reproducer calls the same functions, vendored beside it (spec/repro/templates.py writes this module's
source into ``repro_suite.py``; spec/repro/runtime.py calls them). So they take plain values (each rank's ids and
media as handed, the samples' own dicts, the token ids, the merged groups per kind), import only torch and the
protocol's names, and fail by :func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

import torch

from ..protocol.engine import MEDIA_TOKEN_MARKS, MEDIA_TOKEN_TYPES
from ..protocol.profile import AUDIO_INPUT_KEYS, MEDIA_INPUT_KEYS
from .audio import AUDIO_STRIDE, clips, pad_clips
from .failing import fail

__all__ = ["samples_media", "stack_entries", "joined_ids", "media_inputs_handed"]


def stack_entries(stack) -> list:
    """The per-sample entries of a micro-batch's ``multi_modal_inputs`` (``micro_batch.get(...)``: a
    ``NonTensorStack``, whose ``tolist()`` they are, or the list a tensordict version hands), each
    ``NonTensorData`` unwrapped: a dict, or None for a text-only sample."""
    return [getattr(item, "data", item) for item in (stack.tolist() if hasattr(stack, "tolist") else stack)]


def samples_media(entries) -> dict[str, torch.Tensor]:
    """The samples' media dicts (one per sample, as ``multi_modal_inputs`` holds them; a text-only sample's ``None``,
    ``{}`` or a processor's keys holding ``None``) concatenated per key in sample order, the image keys first, an
    audio clip's features and frame mask padded on their last dimension to the longest sample's (:func:`pad_clips`):
    what a model takes of the batch's media (``{}`` without any)."""
    dicts = [{key: value for key, value in (entry or {}).items() if value is not None} for entry in entries]
    keys = [key for pair in MEDIA_INPUT_KEYS.values() for key in pair if any(key in d for d in dicts)]
    joined = {key: torch.cat([d[key] for d in dicts if key in d]) for key in keys}
    features, mask = AUDIO_INPUT_KEYS
    with_audio = [d for d in dicts if features in d]
    if with_audio:
        joined.update(zip(AUDIO_INPUT_KEYS, pad_clips([d[features] for d in with_audio],
                                                      [d[mask] for d in with_audio])))
    return joined


def joined_ids(ids, total_nnz: int, pad_size: int) -> torch.Tensor:
    """The ids the model embeds, from each rank's ``ids``: the ranks' slices joined, or, where every rank was handed
    the same whole padded row (verl's vision-language Ulysses path), that row."""
    ids = list(ids)
    if len(ids) > 1 and all(torch.equal(i, ids[0]) for i in ids[1:]) and ids[0].shape[-1] == total_nnz + pad_size:
        return ids[0]
    return torch.cat(ids, dim=-1)


def _marks_match(rank: int, ids: torch.Tensor, media: dict, image_id: int, video_id: int) -> None:
    """Where the engine also hands marks of the media tokens (``mm_token_type_ids``: text 0, image 1, video 2;
    VeOmni's ``image_mask`` / ``video_mask``), they mark exactly the media tokens of the ids handed beside them."""
    marks = {MEDIA_TOKEN_TYPES: (ids == image_id).long() + 2 * (ids == video_id).long(),
             "image_mask": (ids == image_id).long(), "video_mask": (ids == video_id).long()}
    for key in set(media) & set(marks):
        have, expected = media[key].detach().cpu(), marks[key]
        if tuple(have.shape) != tuple(expected.shape) or not torch.equal(have.long(), expected):
            wrong = int((have.long() != expected).sum()) if have.shape == expected.shape else -1
            fail(f"rank {rank}: {key!r} of shape {tuple(have.shape)} does not mark the image and video tokens of "
                 f"the input_ids {tuple(ids.shape)} handed beside it ({wrong} positions differ; -1: the shapes "
                 "differ)", key=key)


def _marks_for_own_positions(rank: int, media: dict) -> None:
    """A model handed grids and no ``position_ids`` computes its own rope index; a transformers-5 vision-language
    model finds the media tokens for it by ``mm_token_type_ids`` and refuses without them ("Multimodal data was passed
    (via `image_grid_thw` or `video_grid_thw`) but `mm_token_type_ids` is missing"; Qwen2-VL's
    ``compute_3d_position_ids``), so the engine hands them (OpenRLHF's and SkyRL's forward build them from the ids)."""
    grids = [grid for _, grid in MEDIA_INPUT_KEYS.values() if grid in media]
    if grids and MEDIA_TOKEN_TYPES not in media:
        fail(f"rank {rank}: the model is handed {grids} and no position_ids, so it computes its own rope index, but "
             f"no {MEDIA_TOKEN_TYPES!r} to find the media tokens by (a transformers-5 vision-language model raises "
             f"there); handed {sorted(media)}", key=MEDIA_TOKEN_TYPES)


def media_inputs_handed(handed, want: dict, image_id: int, video_id: int, joined: torch.Tensor,
                        groups: dict, own_positions=None, audio_id: int | None = None, marks=()) -> None:
    """INV-MM-001: ``handed`` is each rank's ``(input_ids, media)`` as handed to the model (media by the model's key
    names, :data:`MEDIA_TOKEN_MARKS` among them where handed); ``want`` the samples' features and grids concatenated
    in sample order (:func:`samples_media`); ``joined`` the ids the model embeds (:func:`joined_ids`); ``groups`` the
    merged groups of each kind (``image``, ``video``; ``audio``: the clips' tokens) the samples' items name. Every rank
    is handed exactly ``want``'s keys and values (audio clips as the frames under their masks, whatever the padding),
    on its ids' device, and the ids hold as many tokens of each kind as its groups (``audio_id``: the audio token id,
    None for a case without audio). ``own_positions``:
    for each rank, whether it hands the model no ``position_ids`` (a Hugging Face model then computes them, from
    the marks); None where the model computes its positions by a rule of its own (Megatron's). ``marks``: the marks
    of the media tokens the engine's model reads to place the features (its profile's ``media_marks``), each handed
    on every rank where the samples carry images or videos."""
    vision = any(key in want for pair in MEDIA_INPUT_KEYS.values() for key in pair)
    for rank, (input_ids, media) in enumerate(handed):
        ids = input_ids.detach().cpu()
        missing = [key for key in marks if key not in media] if vision else []
        if missing:
            fail(f"rank {rank}: the model places the image and video features at {list(marks)}, and is handed no "
                 f"{missing[0]!r} (the features of those tokens land nowhere)", key=missing[0])
        if own_positions is not None and own_positions[rank]:
            _marks_for_own_positions(rank, media)
        _marks_match(rank, ids, media, image_id, video_id)
        got = {key: value for key, value in media.items() if key not in MEDIA_TOKEN_MARKS}
        if set(got) != set(want):
            fail(f"rank {rank}: the model is handed media keys {sorted(got)}, the micro-batch's samples carry "
                 f"{sorted(want)}", key=sorted(set(got) ^ set(want))[0])
        for key, value in want.items():
            have = got[key]
            if have.device != input_ids.device:
                fail(f"rank {rank}: {key!r} is on {have.device}, the ids on {input_ids.device}", key=key)
            if key in AUDIO_INPUT_KEYS:
                continue  # compared as the frames a model reads of them, whatever their padding (below)
            if tuple(have.shape) != tuple(value.shape) or not torch.equal(have.detach().cpu().to(value.dtype), value):
                rows = (have.shape[0] if have.dim() else 0, value.shape[0])
                fail(f"rank {rank}: {key!r} of shape {tuple(have.shape)} is not the samples' {key} concatenated in "
                     f"sample order {tuple(value.shape)} (rows handed {rows[0]}, the samples' {rows[1]})", key=key)
        if AUDIO_INPUT_KEYS[0] in want:
            _clips_match(rank, got, want)
    for token_id, (kind, (_, grids)) in zip((image_id, video_id), MEDIA_INPUT_KEYS.items()):
        tokens = int((joined == token_id).sum())
        if tokens != groups.get(kind, 0):
            fail(f"the ids handed to the model hold {tokens} {kind} tokens, the samples' {grids} name "
                 f"{groups.get(kind, 0)} merged groups", key="input_ids")
    if audio_id is not None:
        tokens = int((joined == audio_id).sum())
        if tokens != groups.get("audio", 0):
            fail(f"the ids handed to the model hold {tokens} audio tokens, the samples' clips take "
                 f"{groups.get('audio', 0)} (frames // {AUDIO_STRIDE} each)", key="input_ids")


def _clips_match(rank: int, got: dict, want: dict) -> None:
    """The audio clips handed equal the samples': as many, in sample order, each the same frames under its mask
    (:func:`spec.truth.audio.clips`; the padding past a clip's mask, how wide and with what, is the engine's)."""
    features, mask = AUDIO_INPUT_KEYS
    try:
        have = clips(got[features].detach().cpu(), got[mask].detach().cpu())
    except ValueError as exc:
        fail(f"rank {rank}: {exc}", key=features)
    expected = clips(want[features], want[mask])
    if len(have) != len(expected):
        fail(f"rank {rank}: {features!r} holds {len(have)} clips, the samples carry {len(expected)}", key=features)
    for k, (h, e) in enumerate(zip(have, expected)):
        if tuple(h.shape) != tuple(e.shape) or not torch.equal(h.to(e.dtype), e):
            fail(f"rank {rank}: audio clip {k} of {features!r} under its {mask!r} is {tuple(h.shape)} "
                 f"(mels, frames), the sample's is {tuple(e.shape)}"
                 + ("" if h.shape != e.shape else " with other values"), key=features if h.shape == e.shape else mask)
