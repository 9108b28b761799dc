"""A case's images and videos as tensors: where their tokens sit, their features, their grids, and the
``multi_modal_inputs`` a trainer hands the engine (one dict per sample, verl's ``NonTensorStack``).

Everything comes from the case's structure (:class:`~spec.cases.structure.Media` items) and its seeded generator,
drawn after every other tensor of the case (:func:`spec.cases.materialize.draws`), so a text-only case's tensors
are what they were before media existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NonTensorData, NonTensorStack

from ..truth.media_checks import samples_media
from ..truth.rules import offsets as _offsets
from ..truth.vision import MEDIA_KEYS, MIN_MEDIA_VOCAB, PATCH_DIM, media_token_ids, rope_index
from .structure import EngineCase, Media

__all__ = ["MediaDraws", "draw_media", "media_stack", "MULTI_MODAL_KEY", "MEDIA_TOKEN_FLAGS", "with_media",
           "fitted_media"]

#: the micro-batch key of the per-sample media dicts (verl's)
MULTI_MODAL_KEY = "multi_modal_inputs"
#: the flags a media micro-batch carries beside it: the model config's image and video token ids (a Hugging Face
#: vision-language config's names), which a library that marks the media tokens itself reads from its model's config
MEDIA_TOKEN_FLAGS = ("image_token_id", "video_token_id")


@dataclass(frozen=True)
class MediaDraws:
    """A media case's tensors: ``per_sample``, each sample's dict as a Qwen2-VL processor returns it (``pixel_values``
    ``(patches, PATCH_DIM)`` float32 and ``image_grid_thw`` ``(k, 3)`` int64 for its images, the video keys for its
    videos; ``{}`` for a text-only sample), and ``rope`` the ``(3, total_nnz)`` rope index of the batch."""

    per_sample: tuple[dict[str, torch.Tensor], ...]
    rope: torch.Tensor

    def model_inputs(self, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The samples' dicts (``rows``, default all, in that order) concatenated per key, as a model takes them."""
        return samples_media([self.per_sample[i] for i in (range(len(self.per_sample)) if rows is None else rows)])


def _token_slots(case: EngineCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat token index of every image token and of every video token of the batch, in order."""
    starts = _offsets(case.seq_lens)[:-1].tolist()
    slots: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    for start, items in zip(starts, case.media):
        at = start
        for item in items:
            at += item.gap
            slots[item.kind].append(torch.arange(at, at + item.tokens))
            at += item.tokens
    empty = torch.zeros(0, dtype=torch.int64)
    return (torch.cat(slots["image"]) if slots["image"] else empty,
            torch.cat(slots["video"]) if slots["video"] else empty)


def draw_media(case: EngineCase, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, MediaDraws]:
    """``ids`` with the media tokens written at their slots (text tokens that drew a media id moved to ``V - 1``, as
    a tokenizer never emits them), and the case's :class:`MediaDraws` (features drawn from ``gen``, item by item in
    sample order)."""
    image_id, video_id = media_token_ids(case.vocab)
    ids = ids.clone()
    ids[(ids == image_id) | (ids == video_id)] = case.vocab - 1
    image_slots, video_slots = _token_slots(case)
    ids[image_slots] = image_id
    ids[video_slots] = video_id
    per_sample = []
    for items in case.media:
        sample: dict[str, list[torch.Tensor]] = {}
        for item in items:
            features, grids = MEDIA_KEYS[item.kind]
            sample.setdefault(features, []).append(torch.randn(item.t * item.h * item.w, PATCH_DIM, generator=gen))
            sample.setdefault(grids, []).append(torch.tensor([item.grid], dtype=torch.int64))
        per_sample.append({key: torch.cat(parts) for key, parts in sample.items()})
    draws = MediaDraws(tuple(per_sample), torch.zeros(3, 0, dtype=torch.int64))
    merged = draws.model_inputs()
    rope = rope_index(ids, case.seq_lens, case.vocab, merged.get("image_grid_thw"), merged.get("video_grid_thw"))
    return ids, MediaDraws(tuple(per_sample), rope)


def media_stack(draws: MediaDraws, case: EngineCase, device: torch.device | str = "cpu") -> NonTensorStack:
    """The ``multi_modal_inputs`` entry of the micro-batch: one ``NonTensorData`` dict per sample, as verl's
    ``get_tensordict`` stores a list of dicts. A text-only sample's is, by the seed (mod 3), ``{}``, ``None`` (verl's
    agent loop hands either) or a processor's keys holding ``None``."""
    empty = ({}, None, {key: None for key in MEDIA_KEYS["image"]})[int(case.seed) % 3]
    items = [{k: v.to(device) for k, v in d.items()} if d else empty for d in draws.per_sample]
    return NonTensorStack.from_list([NonTensorData(item) for item in items])


def with_media(case: EngineCase) -> EngineCase:
    """``case`` as a vision-language micro-batch (an invariant on media forces one; a drawn media case is kept as it
    is): every even sample an image after one text token (4 x 2 and 2 x 4 patches in turn, from the seed), every odd one
    text-only, and sample 0 also a video of two frames in one case in three (by the seed); the prompts lengthened by
    their tokens, mRoPE positions, and a vocabulary with media ids (a smaller one becomes 16, its pad and eos ids
    keeping their places: 0, 1, the last id, the one after the pad)."""
    if case.media:
        return case
    flip = lambda i: (int(case.seed) + i // 2) % 2  # noqa: E731 - alternate 4 x 2 and 2 x 4 grids
    media = tuple((Media("image", 1, 2 + 2 * flip(i), 4 - 2 * flip(i), gap=min(1, p)),) if i % 2 == 0 else ()
                  for i, p in enumerate(case.prompt_lens))
    if int(case.seed) % 3 == 1:
        media = ((*media[0], Media("video", 2, 2, 2, 0)),) + media[1:]
    prompts = tuple(p + sum(m.tokens for m in items) for p, items in zip(case.prompt_lens, media))
    changes: dict = {"prompt_lens": prompts, "media": media, "mrope": True}
    if case.vocab < MIN_MEDIA_VOCAB:
        vocab = 16
        place = lambda i: None if i is None else vocab - 1 if i == case.vocab - 1 else i  # noqa: E731
        changes.update(vocab=vocab, pad_token_id=place(case.pad_token_id), eos_token_id=place(case.eos_token_id),
                       topk=min(case.topk, vocab))
    return case.with_(**changes)


def fitted_media(prompt_lens: tuple[int, ...], seed: int) -> tuple[tuple[Media, ...], ...]:
    """Images inside the prompts as they are (a mini-batch's lengths, drawn against its token budget, stay): every
    sample but one in three (by the seed) an image at its prompt's start, 2 x 4 patches (two tokens) where the prompt
    has room, else 2 x 2 (one); a prompt of four tokens or more also a video of two frames after it."""
    media = []
    for i, p in enumerate(prompt_lens):
        if (i + int(seed)) % 3 == 2:
            media.append(())
            continue
        items = (Media("image", 1, 2, 4 if p >= 2 else 2, 0),)
        if p >= 4:
            items += (Media("video", 2, 2, 2, 0),)
        media.append(items)
    return tuple(media)
