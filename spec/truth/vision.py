"""Images and videos in a micro-batch, as a Qwen2-VL-style model reads them: the rules written once.

A sample's image (or video) is ``t x h x w`` patches (``t = 1`` for an image; a video's frames after temporal
patching); its features are ``pixel_values`` of ``t*h*w`` rows (one per patch, :data:`PATCH_DIM` numbers each; real
Qwen2-VL patches have 1,176) with its grid ``(t, h, w)`` in ``image_grid_thw`` (videos: ``pixel_values_videos``,
``video_grid_thw``). The model merges each :data:`MERGE` x :data:`MERGE` window of patches into one embedding, so
the image takes ``t*h*w / MERGE**2`` tokens of ``input_ids`` (:func:`media_tokens`), all equal to the image token
id; the merged embeddings replace those tokens' embeddings in order (the first image's first group at the batch's
first image token, row-major over the model's ``(R, n)`` ids).

* :func:`media_token_ids`: the image and video token ids of a vocabulary (``V - 2`` and ``V - 3``; media cases need
  ``V >= MIN_MEDIA_VOCAB`` so they differ from the pad and eos ids the strategies draw: 0, 1, 2 and ``V - 1``);
* :func:`rope_index`: Qwen2-VL's ``get_rope_index`` (transformers' ``Qwen2VLModel.get_rope_index``, verl's
  ``verl.models.transformers.qwen2_vl.get_rope_index``), vectorised over every token of a batch: text tokens advance
  all three axes by one; a media item's tokens sit at its base plus their ``(t, h, w)`` index in the merged grid; the
  next token starts one past the largest position so far;
* :func:`tower_weights`, :func:`embed_media`: the stand-in vision tower (a seeded linear map of each merged group of
  patches plus the mean of its image's groups plus its place in the image's merged grid, through ``tanh``): a feature dropped, reordered, handed under
  another grid or placed at other tokens changes what the tokens after it see.

Imports nothing from ``spec`` but the protocol (the truth layer).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..protocol.profile import MEDIA_INPUT_KEYS

__all__ = ["MERGE", "PATCH_DIM", "MIN_MEDIA_VOCAB", "MEDIA_KEYS", "media_token_ids", "media_tokens", "rope_index",
           "tower_weights", "embed_media", "place_media"]

#: Qwen2-VL's spatial merge size: a 2 x 2 window of patches is one token
MERGE = 2
#: the numbers of one patch in ``pixel_values`` (tiny: real Qwen2-VL patches hold 3 x 2 x 14 x 14 = 1,176)
PATCH_DIM = 6
#: the smallest vocabulary a media case draws (the media ids ``V - 2``, ``V - 3`` differ from pad/eos ids 0, 1, 2, V-1)
MIN_MEDIA_VOCAB = 8
#: per media kind: its features' key, its grids' key (what a Qwen2-VL processor returns and the model reads)
MEDIA_KEYS = MEDIA_INPUT_KEYS


def media_token_ids(vocab: int) -> tuple[int, int]:
    """The image and video token ids of a ``vocab``-id model (Qwen2-VL's ``<|image_pad|>``, ``<|video_pad|>``)."""
    if vocab < MIN_MEDIA_VOCAB:
        raise ValueError(f"a vocabulary of {vocab} ids has no room for media tokens (need >= {MIN_MEDIA_VOCAB})")
    return vocab - 2, vocab - 3


def media_tokens(grid_thw: torch.Tensor) -> torch.Tensor:
    """The tokens each item of ``grid_thw`` ``(k, 3)`` takes in ``input_ids``: ``t*h*w / MERGE**2`` (int64 ``(k,)``)."""
    grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3)
    return grid.prod(-1) // (MERGE * MERGE)


def _item_coords(is_media: torch.Tensor, grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """For every token of ``is_media`` (flat): whether it starts a media item, the item's extent (its largest merged
    index + 1 over the three axes) and the token's ``(3,)`` offset in the item's merged grid (zeros elsewhere)."""
    n = is_media.shape[0]
    starts = torch.zeros(n, dtype=torch.bool)
    extent = torch.zeros(n, dtype=torch.int64)
    offset = torch.zeros(3, n, dtype=torch.int64)
    count = int(is_media.sum())
    if grid_thw is None or count == 0:
        return starts, extent, offset
    grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3).cpu()
    llm = grid // torch.tensor([1, MERGE, MERGE])  # the merged grid: (t, h / 2, w / 2)
    tokens = llm.prod(-1)
    ends = tokens.cumsum(0)
    rank = torch.arange(count)  # the k-th media token of the batch
    item = torch.searchsorted(ends, rank, right=True).clamp(max=grid.shape[0] - 1)
    q = rank - (ends - tokens)[item]
    t, h, w = llm[item].unbind(-1)
    where = is_media.nonzero().squeeze(-1)
    starts[where] = q == 0
    extent[where] = torch.stack([t - 1, h - 1, w - 1]).amax(0).clamp(min=0) + 1
    hw = (h * w).clamp(min=1)
    offset[:, where] = torch.stack([q // hw, (q % hw) // w.clamp(min=1), q % w.clamp(min=1)])
    return starts, extent, offset


def rope_index(input_ids: torch.Tensor, lens, vocab: int, image_grid_thw: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen2-VL's ``(3, n)`` mRoPE positions of the flat ``input_ids`` ``(n,)`` of sequences ``lens`` back to back,
    the images' and videos' grids in the order their tokens appear (one grid per item; the items' tokens consecutive).

    As ``get_rope_index`` per sequence: a text token is one past the largest position before it on all three axes (0
    at a sequence's start); an item's tokens sit at ``base + (t, h, w)`` of their index in its merged ``(t, h/2,
    w/2)`` grid (Qwen2-VL's temporal step is 1), ``base`` one past the largest position before it; after it the next
    token is one past ``base + max(t - 1, h/2 - 1, w/2 - 1)``. Vectorised: every token is a segment (a text token, or
    a whole item) of extent 1 or the item's; a segment's base is the sum of the extents before it in its sequence."""
    ids = input_ids.reshape(-1).cpu()
    lens_t = torch.as_tensor([int(n) for n in lens], dtype=torch.int64)
    image_id, video_id = media_token_ids(vocab)
    img_start, img_extent, img_off = _item_coords(ids == image_id, image_grid_thw)
    vid_start, vid_extent, vid_off = _item_coords(ids == video_id, video_grid_thw)
    is_media = (ids == image_id) & (image_grid_thw is not None) | (ids == video_id) & (video_grid_thw is not None)
    extent = torch.where(is_media, img_extent + vid_extent, torch.ones_like(ids))  # the segment's extent
    begins = ~is_media | img_start | vid_start  # the first token of its segment
    contribution = torch.where(begins, extent, torch.zeros_like(extent))
    inclusive = contribution.cumsum(0)
    before = torch.cat([inclusive.new_zeros(1), inclusive])[lens_t.cumsum(0) - lens_t]  # at each sequence's start
    seq_start = torch.repeat_interleave(before, lens_t)
    base = inclusive - seq_start - extent  # the sum of the extents before the token's segment, in its sequence
    return base.unsqueeze(0) + torch.where(is_media, img_off + vid_off, torch.zeros_like(img_off))


@lru_cache(maxsize=16)
def tower_weights(seed: int, hidden: int, device: str) -> tuple[torch.Tensor, ...]:
    """The stand-in vision tower's float64 weights: the map of a merged group ``(4 * PATCH_DIM, hidden)``, the map of
    its item's mean group, a per-kind bias ``(2, hidden)`` (image, video) and the map of a group's ``(t, h, w)`` place
    in its item's merged grid ``(3, hidden)`` (a real tower's 2-D rotary embedding reads the grid so)."""
    gen = torch.Generator().manual_seed(20_011 + int(seed))
    width = MERGE * MERGE * PATCH_DIM
    group = torch.randn(width, hidden, generator=gen, dtype=torch.float64) / width ** 0.5
    context = torch.randn(width, hidden, generator=gen, dtype=torch.float64) / width ** 0.5
    bias = torch.randn(2, hidden, generator=gen, dtype=torch.float64)
    place = 0.5 * torch.randn(3, hidden, generator=gen, dtype=torch.float64)
    return group.to(device), context.to(device), bias.to(device), place.to(device)


def embed_media(pixel_values: torch.Tensor, grid_thw: torch.Tensor | None, weights, kind: int) -> torch.Tensor:
    """``(groups, hidden)`` float64 embeddings of the merged groups of ``pixel_values`` ``(patches, PATCH_DIM)``
    (each :data:`MERGE` ** 2 consecutive rows one group, as Qwen2-VL's processor orders them), each item's groups
    seeing that item's mean group: the items are read off ``grid_thw`` (a grid that disagrees with the rows assigns
    groups to other items, or the last item; leftover rows are dropped, never an error: the harness checks the
    counts). ``kind``: 0 image, 1 video."""
    group_w, context_w, bias, place_w = weights
    size = MERGE * MERGE
    rows = pixel_values.shape[0] // size * size
    groups = pixel_values[:rows].reshape(-1, size * PATCH_DIM).to(group_w.device, torch.float64)
    count = groups.shape[0]
    coords = groups.new_zeros(count, 3)
    if grid_thw is None or torch.as_tensor(grid_thw).numel() == 0:
        item = torch.zeros(count, dtype=torch.int64, device=group_w.device)
        items = 1
    else:
        grid = torch.as_tensor(grid_thw, dtype=torch.int64).reshape(-1, 3).to(group_w.device)
        per_item = media_tokens(grid)
        items = per_item.shape[0]
        ends = per_item.cumsum(0)
        item = torch.searchsorted(ends, torch.arange(count, device=group_w.device), right=True).clamp(max=items - 1)
        q = torch.arange(count, device=group_w.device) - (ends - per_item)[item]
        h, w = (grid[item, 1] // MERGE).clamp(min=1), (grid[item, 2] // MERGE).clamp(min=1)
        coords = torch.stack([q // (h * w), (q % (h * w)) // w, q % w], dim=-1).to(torch.float64)
    total = groups.new_zeros(items, groups.shape[1]).index_add_(0, item, groups)
    sizes = groups.new_zeros(items).index_add_(0, item, groups.new_ones(count)).clamp(min=1.0)
    mean = total / sizes.unsqueeze(-1)
    return torch.tanh(groups @ group_w + mean[item] @ context_w + bias[kind] + coords @ place_w)


def place_media(x: torch.Tensor, input_ids: torch.Tensor, token_id: int, embeds: torch.Tensor) -> torch.Tensor:
    """``x`` ``(R, n, hidden)`` with the media tokens' rows (``input_ids == token_id``, row-major) replaced by
    ``embeds`` in order; where the counts differ, as many as both have (a real model raises; the harness's input
    check reports it, :func:`spec.execute.handoff.check_media_inputs`)."""
    where = (input_ids == token_id).nonzero()
    k = min(where.shape[0], embeds.shape[0])
    if k == 0:
        return x
    out = x.clone()
    out[where[:k, 0], where[:k, 1]] = embeds[:k].to(x.dtype)
    return out
