"""Images and videos, and audio clips (docs/contract.md, "Images and videos", "Audio"; contract clause 14): each
sample's features and grids (an audio clip's frames under its mask) reach the model in sample order beside as many
media tokens, and each sample's outputs are those of the sample run alone with its own media.

INV-MM-003 and INV-MM-004 are INV-MM-001 and INV-MM-002 on an audio micro-batch (:func:`spec.cases.media.with_audio`:
1-D positions, clips of unequal lengths that a trainer pads to the longest), for an engine whose profile lists
``"audio"``.

Both invariants force a vision-language micro-batch on the drawn case (:func:`spec.cases.media.with_media`; a
drawn media case is kept: its counts, grids, videos and text-only samples as drawn), so they share the engine-case
stream and cost one small run per example. Every other engine-case invariant also meets media cases: in a share of
the stream's draws (``spec.cases.strategies``) and in the pinned reach case (``spec.run.runner.REACH_CASES``).
"""

from __future__ import annotations

from ..cases.materialize import draws
from ..cases.media import with_audio, with_media
from ..protocol.profile import MEDIA_INPUT_KEYS, profile_of
from ..truth.audio import audio_token_id
from ..truth.media_checks import joined_ids, media_inputs_handed
from ..truth.vision import media_token_ids
from .core import Ctx, invariant, match_oracle
from .reproduction import Plan

_MEDIA = ("media",)
_AUDIO = ("audio",)


@invariant("INV-MM-001", "the model is handed every sample's image/video features and grids, concatenated in sample "
           "order, beside as many media tokens as their merged patches, on every rank", contract=14,
           protects="each image's features reach its own image tokens, in order (verl #1623/#3315: keys lost or "
           "left on the host)", adjust=with_media, needs=_MEDIA, repro=Plan(("media_handed",)))
def media_handed(ctx: Ctx) -> None:
    """Where the engine also hands marks of the media tokens (``mm_token_type_ids``, which a transformers-5 model
    computes its mRoPE positions from; VeOmni's ``image_mask``/``video_mask``, where its models place the features),
    they mark exactly the image (1) and video (2) tokens of the ids handed beside them; a rank that hands grids and no
    ``position_ids`` (the model computes its own rope index) hands ``mm_token_type_ids``. The check is
    :func:`spec.truth.media_checks.media_inputs_handed` (a reproducer runs the same)."""
    _handed(ctx)


def _handed(ctx: Ctx) -> None:
    """INV-MM-001's and INV-MM-003's check on the run: every rank's ids and media as handed to the model."""
    views = ctx.inputs_run.views
    groups = {kind: sum(m.tokens for items in ctx.case.media for m in items if m.kind == kind)
              for kind in (*MEDIA_INPUT_KEYS, "audio")}
    joined = joined_ids([view.input_ids for view in views], ctx.case.total_nnz, views[0].pad_size)
    media_inputs_handed([(view.input_ids, view.media) for view in views], draws(ctx.case).media_inputs(),
                        *media_token_ids(ctx.case.vocab), joined, groups,
                        own_positions=[view.position_ids is None for view in views],
                        audio_id=audio_token_id(ctx.case.vocab) if ctx.case.has_audio else None,
                        marks=profile_of(ctx.engine).media_marks)


@invariant("INV-MM-002", "with images and videos (text-only samples among them) log_probs equal the oracle's: each "
           "sequence alone with its own images", contract=14,
           protects="a vision-language step's log-probs are those of each sample with its own images, in both modes",
           adjust=lambda c: with_media(c).with_(distillation_only=False, temperature=1.0), needs=_MEDIA,
           repro=Plan(("keys", "values"), keys=("log_probs",)))
def media_values(ctx: Ctx) -> None:
    """At T = 1 (temperatures, and the engines' records on them, are their own invariants'); entropy and the other
    keys on media cases: their own invariants (INV-VAL-*) on the stream's media share."""
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"])


@invariant("INV-MM-003", "the model is handed every sample's audio clips, in sample order, each the same frames under "
           "its feature_attention_mask (whatever the padding to the longest), beside as many audio tokens as the "
           "clips' frames make, on every rank", contract=14,
           protects="each audio clip's frames reach its own audio tokens, and no padding frame is read as audio "
           "(verl's _VARLEN_MULTI_MODAL_KEYS: features padded to the longest sample's frames)",
           adjust=with_audio, needs=_AUDIO, repro=Plan(("media_handed",)))
def audio_handed(ctx: Ctx) -> None:
    """A Qwen2-Audio-style micro-batch: ``input_features`` ``(clips, mels, frames)`` and ``feature_attention_mask``
    ``(clips, frames)``, each sample's clips padded by its processor to its longest, samples' widths unequal; the
    padding past a clip's mask is the engine's (verl pads with zeros to the longest sample's). The check is
    :func:`spec.truth.media_checks.media_inputs_handed` (a reproducer runs the same)."""
    _handed(ctx)


@invariant("INV-MM-004", "with audio clips (text-only samples among them) log_probs equal the oracle's: each sequence "
           "alone with its own clips", contract=14,
           protects="an audio step's log-probs are those of each sample with its own clips, in both modes",
           adjust=lambda c: with_audio(c).with_(distillation_only=False, temperature=1.0), needs=_AUDIO,
           repro=Plan(("keys", "values"), keys=("log_probs",)))
def audio_values(ctx: Ctx) -> None:
    """At T = 1, as INV-MM-002."""
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"])
