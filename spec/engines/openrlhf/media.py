"""A vision-language micro-batch as OpenRLHF's PPO actor hands it to ``Actor.forward``: each sample's processor
outputs (None for a text-only one), as an experience carries them, merged by ``merge_mm_train_inputs``; the VLM
config's media token ids (``_vlm_config``, for the token types the padded path builds); and, padded, the vision
model's own (mRoPE) positions, which the stand-in model is handed as the sample's own (``is_vlm``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ...protocol.engine import MEDIA_TOKEN_TYPES
from ...protocol.profile import MEDIA_INPUT_KEYS
from ..kit.hf_batch import media_samples, media_token_ids

__all__ = ["vlm_args", "with_own_positions"]


def vlm_args(mb: Any, positions: list, packed: bool, config: dict) -> dict[str, Any]:
    """The forward's VLM arguments of ``mb`` (packed: 1-D positions for any model, no VLM path). The config names no
    video token id where the drawn switch says so (``video_token_id``, config.py) and ``mb`` carries no video."""
    image_id, video_id = media_token_ids(mb)
    ids = {"image_token_id": image_id, "video_token_id": video_id}
    if not config.get("video_token_id", True) and not bool((mb["input_ids"].values() == video_id).any()):
        del ids["video_token_id"]  # an images-only model's config (Gemma 3's)
    return {"vlm": positions[0].dim() == 2 and not packed,
            "mm_train_inputs": [d or None for d in media_samples(mb) or ()], "vlm_config": SimpleNamespace(**ids)}


def with_own_positions(inputs: dict, a: dict, positions: list, pad: Any) -> dict:
    """``inputs`` with a VLM's own (mRoPE) positions, right-padded as the rows (a text model's: unchanged). A
    transformers-5 vision-language model computes them from the grids and the token types it is handed
    (``mm_token_type_ids``, which the padded path builds from the ids); handed grids without them it cannot (it
    raises, or an older one falls back to 1-D positions), so the model is then left without positions: the view
    says none were handed (INV-MM-001 asks for the token types) and the stand-in model takes its 1-D ones."""
    grids = any(grid in inputs for _, grid in MEDIA_INPUT_KEYS.values())
    if a["vlm"] and (MEDIA_TOKEN_TYPES in inputs or not grids):
        inputs["position_ids"] = pad(positions, "right", stack=True).transpose(0, 1)
    return inputs
