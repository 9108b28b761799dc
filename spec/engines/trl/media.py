"""A vision-language batch as TRL 1.16's GRPO hands it to ``_get_per_token_logps_and_entropies`` (engine
``trl-fused``; docs/contract.md, "Images and videos").

GRPO runs the processor over the batch's prompts with their images (``processing_class(images=..., text=...,
padding=True)``, prompts left-padded): ``pixel_values`` is every image's patches, image after image in sample order,
``image_grid_thw`` every image's grid, and (transformers 5) ``mm_token_type_ids`` the prompt tokens' types (0 text,
1 image, 2 video), which GRPO extends with zeros over the completions (grpo_trainer.py, ``_generate_and_score_
completions``); ``num_images`` counts each sample's images (0 for a text-only one). GRPO takes images only (its
scoring has no video keys). The backbone is handed what GRPO slices of these per chunk of rows, with the ids and mask
(the fused forward calls ``base_model(**kwargs)``): the adapter records it (:func:`spec.engines.kit.inputs_seen_by_model`)
and hands the stand-in exactly that.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kit.hf_batch import media_samples, media_token_ids, samples
from .vision_families import as_qwen2_vl, family_media

__all__ = ["grpo_media", "seen_by_backbone", "BACKBONE_MEDIA"]

#: what the backbone is handed of GRPO's media, beside the ids and the mask
BACKBONE_MEDIA = ("pixel_values", "image_grid_thw", "mm_token_type_ids")


def grpo_media(mb, pad: Callable[..., torch.Tensor], response_width: int, family: str | None = None) -> dict:
    """GRPO's media keyword arguments for the micro-batch ``mb`` (``{}`` for a text-only one), the completions
    ``response_width`` columns wide; ``pad`` is TRL's ``trl.trainer.utils.pad``; ``family``: Qwen2-VL's layout (None)
    or another family's (:mod:`spec.engines.trl.vision_families`, the ``vision_family`` switch)."""
    per_sample = media_samples(mb)
    if per_sample is None:
        return {}
    image_id, video_id = media_token_ids(mb)
    prompts = samples(mb, "prompts")
    types = pad([(p == image_id).long() + 2 * (p == video_id).long() for p in prompts], 0, "left")
    types = torch.cat([types, types.new_zeros(types.shape[0], response_width)], 1)
    images = [d for d in per_sample if "image_grid_thw" in d]
    kwargs = {"num_images": [len(d["image_grid_thw"]) if "image_grid_thw" in d else 0 for d in per_sample]}
    if family is not None:
        return {**kwargs, **(family_media(family, [_images_of(d) for d in per_sample], types) if images else {})}
    kwargs["mm_token_type_ids"] = types
    if images:
        kwargs["pixel_values"] = torch.cat([d["pixel_values"] for d in images])
        kwargs["image_grid_thw"] = torch.cat([d["image_grid_thw"] for d in images])
    return kwargs


def _images_of(sample: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A sample's images as ``(rows, grid)`` pairs (its processor dict's rows split by the grids)."""
    if "image_grid_thw" not in sample:
        return []
    grids = sample["image_grid_thw"].reshape(-1, 3)
    return list(zip(sample["pixel_values"].split(grids.prod(-1).tolist()), grids))


def seen_by_backbone(calls: list[dict], family: str | None) -> dict:
    """What GRPO handed the backbone over its calls (one a chunk of rows, in order), as the stand-in model reads it:
    the rows' ids and mask, and the media read back into Qwen2-VL's rows and grids (:func:`as_qwen2_vl` where
    ``family`` is another's), each key the chunks' concatenation."""
    read = [{k: call[k] for k in ("input_ids", "attention_mask", *BACKBONE_MEDIA) if k in call} if family is None
            else {**{k: call[k] for k in ("input_ids", "attention_mask")}, **as_qwen2_vl(family, call)}
            for call in calls]
    keys = dict.fromkeys(k for r in read for k in r)
    return {k: torch.cat([r[k] for r in read if k in r]) for k in keys}
