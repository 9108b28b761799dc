"""Audio clips in a micro-batch, as a Qwen2-Audio-style model reads them: the rules written once.

A sample's audio clip is ``frames`` frames of :data:`N_MELS` log-mel numbers. A processor (Whisper's feature
extractor) hands a sample's clips as ``input_features`` ``(clips, N_MELS, F)`` with ``feature_attention_mask``
``(clips, F)``: each clip's frames first, its mask 1 there, then padding frames (the log-mel of silence, not zeros)
under a 0 mask up to the longest clip ``F`` of the sample. Samples' ``F`` differ, so a trainer concatenating several
samples pads the last dimension to the longest (verl's ``_pad_last_dim_and_cat`` for its
``_VARLEN_MULTI_MODAL_KEYS``): how far, and with what, is the engine's business; the model reads a clip's frames
under its mask only (Qwen2.5-Omni's ``input_features[feature_attention_mask.bool()]``, Qwen2-Audio's lengths from
``feature_attention_mask.sum(-1)``). The audio encoder turns every :data:`AUDIO_STRIDE` frames into one token: a
clip of ``frames`` frames takes ``frames // AUDIO_STRIDE`` audio tokens in ``input_ids``, all equal to the audio token
id, whose embeddings the clips' tokens replace in order. Audio tokens take 1-D positions as text does (Qwen2-Audio is
a text model with an audio tower).

* :func:`audio_token_id`: the audio token id of a vocabulary (``V - 4``: media cases have ``V >= MIN_MEDIA_VOCAB``);
* :func:`clips`: the frames a model reads of ``(input_features, feature_attention_mask)``, clip by clip (the
  comparison of what an engine hands, whatever its padding: :mod:`spec.truth.media_checks`);
* :func:`pad_clips`: several samples' features and masks concatenated, the last dimension padded to the longest;
* :func:`audio_weights`, :func:`embed_audio`: the stand-in audio tower (a seeded linear map of each
  ``AUDIO_STRIDE``-frame group plus its clip's mean group, through ``tanh``): a clip dropped, reordered, cut, read past
  its mask or placed at other tokens changes what the tokens after it see.

Imports nothing from ``spec`` but the protocol (the truth layer).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..protocol.profile import AUDIO_INPUT_KEYS

__all__ = ["N_MELS", "AUDIO_STRIDE", "AUDIO_KEYS", "audio_token_id", "clips", "pad_clips", "audio_weights",
           "embed_audio"]

#: the log-mel bins of one frame (tiny: Whisper's have 128 or 80)
N_MELS = 3
#: frames per audio token (Whisper's encoder halves the frames by a strided convolution, Qwen2-Audio pools by 2 more)
AUDIO_STRIDE = 2
#: the features' key and the mask's key, in a sample's ``multi_modal_inputs`` entry and in the model's arguments
AUDIO_KEYS = AUDIO_INPUT_KEYS


def audio_token_id(vocab: int) -> int:
    """The audio token id of a ``vocab``-id model (Qwen2-Audio's ``<|AUDIO|>``): ``V - 4``."""
    if vocab < 8:
        raise ValueError(f"a vocabulary of {vocab} ids has no room for media tokens (need >= 8)")
    return vocab - 4


def clips(features: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The ``(N_MELS, frames)`` frames under the mask of each clip of ``features`` ``(clips, N_MELS, F)`` (what a model
    reads of it), in order; ``mask`` ``(clips, F)``. Shapes that do not pair raise ``ValueError`` naming them."""
    if features.dim() != 3 or mask.dim() != 2 or features.shape[0] != mask.shape[0] or \
            features.shape[-1] != mask.shape[-1]:
        raise ValueError(f"{AUDIO_KEYS[0]!r} of shape {tuple(features.shape)} and {AUDIO_KEYS[1]!r} of shape "
                         f"{tuple(mask.shape)} do not pair as (clips, mels, frames) and (clips, frames)")
    keep = mask.bool()
    return [clip[:, row] for clip, row in zip(features, keep)]


def pad_clips(features: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several samples' ``(k_i, N_MELS, F_i)`` features and ``(k_i, F_i)`` masks concatenated over the clips, the last
    dimension padded with zeros (mask 0) to the longest ``F_i``: what a model takes of them."""
    width = max(f.shape[-1] for f in features)
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
    return torch.cat([pad(f) for f in features]), torch.cat([pad(m) for m in masks])


@lru_cache(maxsize=16)
def audio_weights(seed: int, hidden: int, device: str) -> tuple[torch.Tensor, ...]:
    """The stand-in audio tower's float64 weights: the map of a group of :data:`AUDIO_STRIDE` frames
    ``(AUDIO_STRIDE * N_MELS, hidden)``, the map of its clip's mean group, and a bias ``(hidden,)``."""
    gen = torch.Generator().manual_seed(30_011 + int(seed))
    width = AUDIO_STRIDE * N_MELS
    group = torch.randn(width, hidden, generator=gen, dtype=torch.float64) / width ** 0.5
    context = torch.randn(width, hidden, generator=gen, dtype=torch.float64) / width ** 0.5
    bias = torch.randn(hidden, generator=gen, dtype=torch.float64)
    return group.to(device), context.to(device), bias.to(device)


def embed_audio(features: torch.Tensor, mask: torch.Tensor | None, weights) -> torch.Tensor:
    """``(tokens, hidden)`` float64 embeddings of the clips of ``features`` ``(clips, N_MELS, F)``: each clip's frames
    under ``mask`` (all ``F`` where None), every :data:`AUDIO_STRIDE` of them one token (a clip's leftover frames are
    dropped), each token seeing its clip's mean token. Vectorised over the clips: the frames under the mask, flat in
    clip order, each given its clip and its place in it."""
    group_w, context_w, bias = weights
    if mask is None:
        mask = features.new_ones(features.shape[0], features.shape[-1])
    keep = mask.bool().to(features.device)
    frames = features.transpose(1, 2)[keep].to(group_w.device, torch.float64)  # (valid frames, N_MELS)
    lengths = keep.sum(-1).to(group_w.device)
    clip = torch.repeat_interleave(torch.arange(lengths.shape[0], device=group_w.device), lengths)
    place = torch.arange(frames.shape[0], device=group_w.device) - (lengths.cumsum(0) - lengths)[clip]
    tokens = lengths // AUDIO_STRIDE
    used = place < tokens[clip] * AUDIO_STRIDE
    token = ((tokens.cumsum(0) - tokens)[clip] + place // AUDIO_STRIDE)[used]
    count = int(tokens.sum())
    groups = frames.new_zeros(count, AUDIO_STRIDE, frames.shape[-1])
    groups[token, (place % AUDIO_STRIDE)[used]] = frames[used]
    groups = groups.reshape(count, -1)
    owner = torch.repeat_interleave(torch.arange(tokens.shape[0], device=group_w.device), tokens)
    total = groups.new_zeros(tokens.shape[0], groups.shape[1]).index_add_(0, owner, groups)
    mean = total / tokens.clamp(min=1).unsqueeze(-1).to(torch.float64)
    return torch.tanh(groups @ group_w + mean[owner] @ context_w + bias)
