"""Other vision-language families' processor outputs, as TRL 1.16's GRPO hands them to
``_get_per_token_logps_and_entropies`` and slices them per chunk of rows (trl-fused's ``vision_family`` switch,
config.py).

The case's images are Qwen2-VL's: each image's patches (``MERGE ** 2`` consecutive rows a token, spec.truth.vision)
with its grid ``(1, h, w)``. A family lays the same images out as its processor returns them; GRPO picks its slicing
by the keys it finds (grpo_trainer.py lines 1454-1488):

* ``llava_next`` (LLaVA-NeXT): ``pixel_values`` per image ``(images, P, D)``, zero-padded, with ``image_sizes``
  ``(images, 2)``, each image's ``(h, w)``: sliced per image;
* ``gemma3`` (Gemma 3): ``pixel_values`` per image, each a fixed-size image, with ``token_type_ids`` ``(B, L)``, 1 at
  the image tokens (0 over the completions): images sliced per image, the types per row;
* ``gemma4`` (Gemma 4): ``pixel_values`` per image with ``image_position_ids`` ``(images, P, 2)``, each patch's
  ``(row, column)`` in its image, -1 on the padding: sliced per image;
* ``idefics3`` (Idefics3, SmolVLM): ``pixel_values`` per sample ``(B, K, P, D)``, its ``K`` image slots zero where
  it has fewer, with ``pixel_attention_mask`` ``(B, K, H, W)`` true over each image's ``h x w`` patches: sliced per
  row;
* ``internvl`` (InternVL): ``pixel_values`` per tile ``(tiles, 1 + MERGE ** 2, D)``, each tile one token's patches,
  with ``num_tiles`` per sample (GRPO counts tiles only where they are not the images, lines 2546-2554): sliced per
  tile;
* ``lfm2_vl`` (LFM2-VL): ``pixel_values`` per tile ``(tiles, P, D)`` (an image one tile here) with
  ``pixel_attention_mask`` ``(tiles, P)`` and ``spatial_shapes`` ``(tiles, 2)``, and ``num_tiles`` per sample:
  sliced per tile.

A fixed-size image or tile (``gemma3``, ``internvl``) carries no size of its own; the stand-in's keeps its grid in a
first row ``(1, h, w, n, 0, ...)`` (``n``: the tiles its image is cut into), as a real tower knows its one input
size. :func:`as_qwen2_vl` reads what the backbone was handed back into rows and grids, the keys the stand-in model
reads: an image sliced off its row, its size or its mask reaches the model as other patches, or under another grid.
"""

from __future__ import annotations

import torch

from ...cases import EngineCase
from ...cases.structure import Media
from ...truth.vision import MERGE

__all__ = ["FAMILIES", "family_media", "as_qwen2_vl", "FAMILY_KEYS", "FAMILY_CASES"]

#: the families ``vision_family`` draws beside Qwen2-VL's own layout (None)
FAMILIES = ("llava_next", "gemma3", "gemma4", "idefics3", "internvl", "lfm2_vl")
#: the keys a family hands the backbone beside the ids and the mask
FAMILY_KEYS = ("pixel_values", "image_sizes", "token_type_ids", "image_position_ids", "pixel_attention_mask",
               "spatial_shapes")
_WINDOW = MERGE * MERGE


def _padded(units: list[torch.Tensor], width: int) -> torch.Tensor:
    """``units`` (each ``(rows, D)``) stacked, each zero-padded to ``width`` rows."""
    return torch.stack([torch.nn.functional.pad(u, (0, 0, 0, width - u.shape[0])) for u in units])


def _headed(rows: torch.Tensor, grid: torch.Tensor, tiles: int, width: int) -> torch.Tensor:
    """``rows`` behind the stand-in's size row ``(1, h, w, tiles, 0, ...)``, zero-padded to ``width`` rows."""
    head = rows.new_zeros(1, rows.shape[1])
    head[0, :4] = torch.tensor([1, int(grid[1]), int(grid[2]), tiles], dtype=rows.dtype)
    return torch.nn.functional.pad(torch.cat([head, rows]), (0, 0, 0, width - rows.shape[0]))


def _patch_places(grid: torch.Tensor, width: int) -> torch.Tensor:
    """Each patch's ``(row, column)`` in its image (the processor's window order: ``MERGE x MERGE`` windows row-major,
    each window's patches row-major), ``(width, 2)``, -1 past the image's ``h * w`` patches."""
    h, w = int(grid[1]), int(grid[2])
    q = torch.arange(h * w)
    window, inner = q // _WINDOW, q % _WINDOW
    places = torch.stack([MERGE * (window // (w // MERGE)) + inner // MERGE,
                          MERGE * (window % (w // MERGE)) + inner % MERGE], -1)
    return torch.nn.functional.pad(places, (0, 0, 0, width - h * w), value=-1)


def family_media(family: str, images: list[list[tuple[torch.Tensor, torch.Tensor]]], types: torch.Tensor) -> dict:
    """GRPO's media keyword arguments for ``family``: ``images`` per sample, each image's ``(rows, grid)``;
    ``types`` ``(B, L)`` the rows' token types (1 at an image token; GRPO's zeros over the completions)."""
    flat = [image for sample in images for image in sample]
    width = max(rows.shape[0] for rows, _ in flat)
    per_image = _padded([rows for rows, _ in flat], width)
    if family == "llava_next":
        return {"pixel_values": per_image, "image_sizes": torch.stack([grid[1:] for _, grid in flat])}
    if family == "gemma3":
        return {"pixel_values": torch.stack([_headed(rows, grid, 1, width) for rows, grid in flat]),
                "token_type_ids": types}
    if family == "gemma4":
        return {"pixel_values": per_image,
                "image_position_ids": torch.stack([_patch_places(grid, width) for _, grid in flat])}
    if family == "idefics3":
        slots = max(len(sample) for sample in images)
        side = max(int(g[1:].max()) for _, g in flat)
        pixels = per_image.new_zeros(len(images), slots, width, per_image.shape[-1])
        mask = torch.zeros(len(images), slots, side, side, dtype=torch.bool)
        for b, sample in enumerate(images):  # the processor's own per-sample loop; a handful of images
            for k, (rows, grid) in enumerate(sample):
                pixels[b, k, :rows.shape[0]] = rows
                mask[b, k, :int(grid[1]), :int(grid[2])] = True
        return {"pixel_values": pixels, "pixel_attention_mask": mask}
    if family == "internvl":
        tiles = [_headed(rows[t:t + _WINDOW], grid, rows.shape[0] // _WINDOW, _WINDOW)
                 for rows, grid in flat for t in range(0, rows.shape[0], _WINDOW)]
        out = {"pixel_values": torch.stack(tiles)}
        if len(tiles) != len(flat):  # GRPO counts tiles only where they are not the images
            out["num_tiles"] = [sum(rows.shape[0] // _WINDOW for rows, _ in sample) for sample in images]
        return out
    if family == "lfm2_vl":
        return {"pixel_values": per_image, "num_tiles": [len(sample) for sample in images],
                "pixel_attention_mask": torch.arange(width) < torch.tensor([[r.shape[0]] for r, _ in flat]),
                "spatial_shapes": torch.stack([grid[1:] for _, grid in flat])}
    raise ValueError(f"vision_family: {family!r} is none of {FAMILIES}")


def _unheaded(units: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fixed-size images or tiles (their size rows first) read back into each image's rows and grid."""
    rows, grids, k = [], [], 0
    while k < units.shape[0]:
        h, w, n = (int(v) for v in units[k, 0, 1:4])
        rows.append(torch.cat([units[k + j, 1:] for j in range(max(n, 1))])[:h * w])
        grids.append(torch.tensor([1, h, w]))
        k += max(n, 1)
    return rows, grids


def as_qwen2_vl(family: str, seen: dict) -> dict:
    """What the backbone was handed of ``family``'s media (one call's keyword arguments) as the stand-in model reads
    images: ``pixel_values`` rows and ``image_grid_thw``, read back through the family's own sizes and masks."""
    pixels = seen.get("pixel_values")
    if pixels is None:
        return {}
    if family in ("gemma3", "internvl"):
        rows, grids = _unheaded(pixels)
    elif family in ("llava_next", "lfm2_vl"):
        sizes = seen["image_sizes" if family == "llava_next" else "spatial_shapes"]
        grids = [torch.tensor([1, int(h), int(w)]) for h, w in sizes.tolist()]
        rows = [image[:int(g[1] * g[2])] for image, g in zip(pixels, grids)]
    elif family == "gemma4":
        places = seen["image_position_ids"]
        grids = [torch.tensor([1, int(p[..., 0].max()) + 1, int(p[..., 1].max()) + 1]) for p in places]
        rows = [image[p[..., 0] >= 0] for image, p in zip(pixels, places)]
    elif family == "idefics3":
        mask = seen["pixel_attention_mask"]
        if mask.shape[:2] != pixels.shape[:2]:  # the model masks its image slots with it (Idefics3: an IndexError)
            raise ValueError(f"pixel_values {tuple(pixels.shape)} and pixel_attention_mask {tuple(mask.shape)} hold "
                             "other image slots: the mask indexes other rows' images")
        real = mask.flatten(2).any(-1)
        hs, ws = mask.any(-1).sum(-1)[real].tolist(), mask.any(-2).sum(-1)[real].tolist()
        grids = [torch.tensor([1, h, w]) for h, w in zip(hs, ws)]
        rows = [image[:h * w] for image, h, w in zip(pixels[real], hs, ws)]
    else:
        raise ValueError(f"vision_family: {family!r} is none of {FAMILIES}")
    if not rows:
        return {}
    return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.stack(grids).to(torch.int64)}


#: trl-fused's reach cases (its profile's ``reach_cases``): each family on an image batch GRPO scores in chunks, the
#: images spread unevenly over three rows (two, none, one: as many images as rows), of one and of two tokens; the
#: draws give a family an image batch on about one case in a hundred
FAMILY_CASES = tuple(
    EngineCase(prompt_lens=(5, 2, 4), response_lens=(2, 1, 3), vocab=16, mrope=True,
               media=((Media("image", 1, 2, 4, 1), Media("image", 1, 2, 2, 0)), (), (Media("image", 1, 4, 2, 1),)),
               engine_config=(("score_chunk", chunk), ("vision_family", family)))
    for family, chunk in zip(FAMILIES, (1, 2, 1, 1, 2, 1)))
