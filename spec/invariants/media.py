"""Images and videos (docs/contract.md, "Images and videos"; contract clause 14): each sample's features and grids
reach the model in sample order beside as many media tokens, and each sample's outputs are those of the sample run
alone with its own images.

Both invariants force a vision-language micro-batch on the drawn case (:func:`spec.cases.media.with_media`; a
drawn media case is kept: its counts, grids, videos and text-only samples as drawn), so they share the engine-case
stream and cost one small run per example. Every other engine-case invariant also meets media cases: in a share of
the stream's draws (``spec.cases.strategies``) and in the pinned reach case (``spec.run.runner.REACH_CASES``).
"""

from __future__ import annotations

import torch

from ..cases.materialize import draws
from ..cases.media import with_media
from ..protocol.engine import MEDIA_TOKEN_MARKS, MEDIA_TOKEN_TYPES
from ..protocol.profile import MEDIA_INPUT_KEYS
from ..truth.vision import media_token_ids
from .core import Ctx, fail, invariant, match_oracle

_MEDIA = ("media",)


def _joined_ids(ctx: Ctx) -> torch.Tensor:
    """The ids the model embeds: the ranks' slices joined (or, where every rank was handed the same whole padded row,
    verl's vision-language Ulysses path, that row)."""
    ids = [view.input_ids for view in ctx.inputs_run.views]
    if len(ids) > 1 and all(torch.equal(i, ids[0]) for i in ids[1:]) and \
            ids[0].shape[-1] == ctx.case.total_nnz + ctx.inputs_run.views[0].pad_size:
        return ids[0]
    return torch.cat(ids, dim=-1)


@invariant("INV-MM-001", "the model is handed every sample's image/video features and grids, concatenated in sample "
           "order, beside as many media tokens as their merged patches, on every rank", contract=14,
           protects="each image's features reach its own image tokens, in order (verl #1623/#3315: keys lost or "
           "left on the host)", adjust=with_media, needs=_MEDIA)
def media_handed(ctx: Ctx) -> None:
    """Where the engine also hands marks of the media tokens (``mm_token_type_ids``, which a transformers-5 model
    computes its mRoPE positions from; VeOmni's ``image_mask``/``video_mask``, where its models place the features),
    they mark exactly the image (1) and video (2) tokens of the ids handed beside them."""
    want = draws(ctx.case).media_inputs()
    image_id, video_id = media_token_ids(ctx.case.vocab)
    for rank, view in enumerate(ctx.inputs_run.views):
        got = {key: value for key, value in view.media.items() if key not in MEDIA_TOKEN_MARKS}
        ids = view.input_ids.detach().cpu()
        marks = {MEDIA_TOKEN_TYPES: (ids == image_id).long() + 2 * (ids == video_id).long(),
                 "image_mask": (ids == image_id).long(), "video_mask": (ids == video_id).long()}
        for key in set(view.media) & set(marks):
            have, expected = view.media[key].detach().cpu(), marks[key]
            if tuple(have.shape) != tuple(expected.shape) or not torch.equal(have.long(), expected):
                wrong = int((have.long() != expected).sum()) if have.shape == expected.shape else -1
                fail(f"rank {rank}: {key!r} of shape {tuple(have.shape)} does not mark the image and video tokens of "
                     f"the input_ids {tuple(ids.shape)} handed beside it ({wrong} positions differ; -1: the shapes "
                     "differ)", key=key)
        if set(got) != set(want):
            fail(f"rank {rank}: the model is handed media keys {sorted(got)}, the micro-batch's samples carry "
                 f"{sorted(want)}", key=sorted(set(got) ^ set(want))[0])
        for key, value in want.items():
            have = got[key]
            if have.device != view.input_ids.device:
                fail(f"rank {rank}: {key!r} is on {have.device}, the ids on {view.input_ids.device}", key=key)
            if tuple(have.shape) != tuple(value.shape) or not torch.equal(have.detach().cpu().to(value.dtype), value):
                rows = (have.shape[0] if have.dim() else 0, value.shape[0])
                fail(f"rank {rank}: {key!r} of shape {tuple(have.shape)} is not the samples' {key} concatenated in "
                     f"sample order {tuple(value.shape)} (rows handed {rows[0]}, the samples' {rows[1]})", key=key)
    ids = _joined_ids(ctx)
    for token_id, (kind, (features, grids)) in zip(media_token_ids(ctx.case.vocab), MEDIA_INPUT_KEYS.items()):
        tokens = int((ids == token_id).sum())
        groups = sum(m.tokens for items in ctx.case.media for m in items if m.kind == kind)
        if tokens != groups:
            fail(f"the ids handed to the model hold {tokens} {kind} tokens, the samples' {grids} name {groups} "
                 "merged groups", key="input_ids")


@invariant("INV-MM-002", "with images and videos (text-only samples among them) log_probs equal the oracle's: each "
           "sequence alone with its own images", contract=14,
           protects="a vision-language step's log-probs are those of each sample with its own images, in both modes",
           adjust=lambda c: with_media(c).with_(distillation_only=False, temperature=1.0), needs=_MEDIA)
def media_values(ctx: Ctx) -> None:
    """At T = 1 (temperatures, and the engines' records on them, are their own invariants'); entropy and the other
    keys on media cases: their own invariants (INV-VAL-*) on the stream's media share."""
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"])
