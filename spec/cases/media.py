"""A case's images and videos, or its audio clips, as tensors: where their tokens sit, their features, their grids
(an audio clip's frame mask), and the ``multi_modal_inputs`` a trainer hands the engine (one dict per sample, verl's
``NonTensorStack``).

Everything comes from the case's structure (:class:`~spec.cases.structure.Media` items) and its seeded generator,
drawn after every other tensor of the case (:func:`spec.cases.materialize.draws`), so a text-only case's tensors
are what they were before media existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NonTensorData, NonTensorStack

from ..protocol.profile import MEDIA
from ..truth.audio import AUDIO_KEYS, N_MELS, audio_token_id
from ..truth.media_checks import samples_media
from ..truth.rules import offsets as _offsets
from ..truth.vision import MEDIA_KEYS, MIN_MEDIA_VOCAB, PATCH_DIM, media_token_ids, rope_index
from .structure import EngineCase, Media

__all__ = ["MediaDraws", "draw_media", "media_stack", "MULTI_MODAL_KEY", "MEDIA_TOKEN_FLAGS", "with_media",
           "with_audio", "fitted_media"]

#: the micro-batch key of the per-sample media dicts (verl's)
MULTI_MODAL_KEY = "multi_modal_inputs"
#: the flags a media micro-batch carries beside it: the model config's image and video token ids (a Hugging Face
#: vision-language config's names), which a library that marks the media tokens itself reads from its model's config
MEDIA_TOKEN_FLAGS = ("image_token_id", "video_token_id")


@dataclass(frozen=True)
class MediaDraws:
    """A media case's tensors: ``per_sample``, each sample's dict as a Qwen2-VL processor returns it (``pixel_values``
    ``(patches, PATCH_DIM)`` float32 and ``image_grid_thw`` ``(k, 3)`` int64 for its images, the video keys for its
    videos; an audio sample's ``input_features`` and ``feature_attention_mask`` as a Whisper feature extractor returns
    them; ``{}`` for a text-only sample), and ``rope`` the ``(3, total_nnz)`` rope index of the batch (``(3, 0)`` for
    audio: 1-D positions)."""

    per_sample: tuple[dict[str, torch.Tensor], ...]
    rope: torch.Tensor

    def model_inputs(self, rows: list[int] | None = None) -> dict[str, torch.Tensor]:
        """The samples' dicts (``rows``, default all, in that order) concatenated per key, as a model takes them."""
        return samples_media([self.per_sample[i] for i in (range(len(self.per_sample)) if rows is None else rows)])


def _token_slots(case: EngineCase) -> dict[str, torch.Tensor]:
    """Per media kind, the flat token index of every one of its tokens in the batch, in order."""
    starts = _offsets(case.seq_lens)[:-1].tolist()
    slots: dict[str, list[torch.Tensor]] = {kind: [] for kind in MEDIA}
    for start, items in zip(starts, case.media):
        at = start
        for item in items:
            at += item.gap
            slots[item.kind].append(torch.arange(at, at + item.tokens))
            at += item.tokens
    return {kind: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64) for kind, parts in slots.items()}


def _audio_inputs(items: list[Media], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A sample's audio clips as a Whisper feature extractor hands them: ``(clips, N_MELS, F)`` features padded to the
    sample's longest clip ``F`` with the log-mel of silence (one drawn constant per sample, not zeros), and the
    ``(clips, F)`` int64 mask of each clip's frames."""
    width = max(item.frames for item in items)
    silence = torch.randn(1, generator=gen).item()
    features = torch.full((len(items), N_MELS, width), silence)
    mask = torch.zeros(len(items), width, dtype=torch.int64)
    for k, item in enumerate(items):
        features[k, :, :item.frames] = torch.randn(N_MELS, item.frames, generator=gen)
        mask[k, :item.frames] = 1
    return dict(zip(AUDIO_KEYS, (features, mask)))


def draw_media(case: EngineCase, ids: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, MediaDraws]:
    """``ids`` with the media tokens written at their slots (text tokens that drew a media id moved to ``V - 1``, as
    a tokenizer never emits them), and the case's :class:`MediaDraws` (features drawn from ``gen``, item by item in
    sample order; an audio case's rope index is empty: it has 1-D positions)."""
    image_id, video_id = media_token_ids(case.vocab)
    token_ids = {"image": image_id, "video": video_id, "audio": audio_token_id(case.vocab)}
    ids = ids.clone()
    ids[(ids == image_id) | (ids == video_id)] = case.vocab - 1
    if case.has_audio:
        ids[ids == token_ids["audio"]] = case.vocab - 1
    for kind, slots in _token_slots(case).items():
        ids[slots] = token_ids[kind]
    per_sample = []
    for items in case.media:
        sample: dict[str, list[torch.Tensor]] = {}
        for item in items:
            if item.kind == "audio":
                continue
            features, grids = MEDIA_KEYS[item.kind]
            sample.setdefault(features, []).append(torch.randn(item.t * item.h * item.w, PATCH_DIM, generator=gen))
            sample.setdefault(grids, []).append(torch.tensor([item.grid], dtype=torch.int64))
        clips = [item for item in items if item.kind == "audio"]
        per_sample.append({**{key: torch.cat(parts) for key, parts in sample.items()},
                           **(_audio_inputs(clips, gen) if clips else {})})
    draws = MediaDraws(tuple(per_sample), torch.zeros(3, 0, dtype=torch.int64))
    if case.has_audio:
        return ids, draws
    merged = draws.model_inputs()
    rope = rope_index(ids, case.seq_lens, case.vocab, merged.get("image_grid_thw"), merged.get("video_grid_thw"))
    return ids, MediaDraws(tuple(per_sample), rope)


def media_stack(draws: MediaDraws, case: EngineCase, device: torch.device | str = "cpu") -> NonTensorStack:
    """The ``multi_modal_inputs`` entry of the micro-batch: one ``NonTensorData`` dict per sample, as verl's
    ``get_tensordict`` stores a list of dicts. A text-only sample's is, by the seed (mod 3), ``{}``, ``None`` (verl's
    agent loop hands either) or a processor's keys holding ``None``."""
    keys = AUDIO_KEYS if case.has_audio else MEDIA_KEYS["image"]
    empty = ({}, None, {key: None for key in keys})[int(case.seed) % 3]
    items = [{k: v.to(device) for k, v in d.items()} if d else empty for d in draws.per_sample]
    return NonTensorStack.from_list([NonTensorData(item) for item in items])


def with_media(case: EngineCase) -> EngineCase:
    """``case`` as a vision-language micro-batch (an invariant on media forces one; a drawn media case is kept as it
    is): every even sample an image after one text token (4 x 2 and 2 x 4 patches in turn, from the seed), every odd one
    text-only, and sample 0 also a video of two frames in one case in three (by the seed); the prompts lengthened by
    their tokens, mRoPE positions, and a vocabulary with media ids (a smaller one becomes 16, its pad and eos ids
    keeping their places: 0, 1, the last id, the one after the pad); a drawn audio case becomes one."""
    if case.media and not case.has_audio:
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


def with_audio(case: EngineCase) -> EngineCase:
    """``case`` as an audio micro-batch (an invariant on audio forces one; a drawn audio case is kept as it is): every
    even sample a clip after one text token, of 4, 5 or 6 frames by the seed and its place (2, 2 and 3 tokens: samples'
    clips of unequal lengths, which a trainer pads to the longest, and one frame past a whole token), every odd one
    text-only, and sample 0 a second, longer clip in one case in three (a sample's own clips padded to its longest);
    the prompts lengthened by their tokens, 1-D positions, and a vocabulary with media ids (a smaller one becomes 16,
    its pad and eos ids keeping their places, as :func:`with_media`)."""
    if case.has_audio:
        return case
    frames = lambda i: 4 + (int(case.seed) + i // 2) % 3  # noqa: E731
    media = tuple((Media("audio", gap=min(1, p), frames=frames(i)),) if i % 2 == 0 else ()
                  for i, p in enumerate(case.prompt_lens))
    if int(case.seed) % 3 == 1:
        media = ((*media[0], Media("audio", gap=0, frames=7)),) + media[1:]
    prompts = tuple(p + sum(m.tokens for m in items) for p, items in zip(case.prompt_lens, media))
    changes: dict = {"prompt_lens": prompts, "media": media, "mrope": False}
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
