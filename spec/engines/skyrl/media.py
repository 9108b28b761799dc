"""A vision-language micro-batch as skyrl 0.4.0's ``HFModelWrapper.forward`` takes it (engine ``skyrl``; docs/contract.md,
"Images and videos").

A model whose config has a ``vision_config`` is a VLM (``is_vlm``): ``forward`` refuses packing for it
(``remove_microbatch_padding``: the profile's ``mrope_modes``), hands it ``position_ids=None`` (the model computes its
mRoPE positions: the adapter hands the stand-in each sample's own, laid out as SkyRL's left-padded rows), the images
concatenated from per-sample ``TensorList`` s and ``mm_token_type_ids`` marking the ids equal to
``config.image_token_id``. The ``TensorList`` s are built as SkyRL's Tinker backend builds them
(``skyrl.backends.skyrl_train_backend``, ``_to_training_batch``): one tensor per sample, an empty placeholder for a
text-only sample of a mixed batch. SkyRL takes images only (no video keys).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch

from ...protocol import PaddedLayout
from ...protocol.engine import MEDIA_TOKEN_TYPES
from ...protocol.profile import MEDIA_INPUT_KEYS, token_columns
from ..kit.hf_batch import media_samples, media_token_ids, samples

__all__ = ["VisionModel", "vlm_inputs", "own_positions", "with_own_positions"]

_KEYS = ("pixel_values", "image_grid_thw")


class VisionModel:
    """The model ``forward`` calls, with the config a VLM has (``image_token_id``, ``vision_config``)."""

    def __init__(self, model: Any, image_token_id: int):
        self.model = model
        self.config = SimpleNamespace(image_token_id=image_token_id, vision_config=SimpleNamespace())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


def vlm_inputs(mb, wrapper: type, config: dict | None = None) -> dict[str, Any]:
    """``forward``'s image keyword arguments for ``mb`` (``{}`` without media): per key a ``TensorList`` (SkyRL's,
    from the module of ``wrapper``, its ``HFModelWrapper``) of each sample's tensor, a text-only sample's an empty
    placeholder of the others' trailing shape;
    the samples' tensors concatenated, as the Hugging Face model takes them, where ``config`` draws the
    ``images_concatenated`` switch (spec/engines/skyrl/config.py)."""
    per_sample, tensor_list = media_samples(mb), sys.modules[wrapper.__module__].TensorList
    if per_sample is None:
        return {}
    out = {}
    for key in _KEYS:
        values = [d.get(key) for d in per_sample]
        ref = next((v for v in values if v is not None), None)
        if ref is not None:
            placeholder = torch.empty(0, *ref.shape[1:], dtype=ref.dtype, device=ref.device)
            tensors = [v if v is not None else placeholder for v in values]
            out[key] = torch.cat(tensors) if (config or {}).get("images_concatenated") else tensor_list(tensors)
    return out


def own_positions(mb) -> torch.Tensor:
    """Each sample's own mRoPE positions ``(4, B, L)`` in SkyRL's rows (left-padded whole sequences), 0 elsewhere:
    what a Qwen2-VL model computes from the ids, the grids and the mask when handed ``position_ids=None``."""
    pos = samples(mb, "position_ids")  # (n_i, 4) each
    prompt_lens, response_lens = (mb[k].offsets().diff() for k in ("prompts", "responses"))
    rows, cols, width = token_columns(PaddedLayout.LEFT, prompt_lens, response_lens)
    values = torch.cat(pos).T
    out = values.new_zeros(values.shape[0], len(pos), width)
    out[:, rows.to(values.device), cols.to(values.device)] = values
    return out


def image_token_id(mb) -> int:
    """The VLM config's image token id (the micro-batch's flag beside its media)."""
    return media_token_ids(mb)[0]


def with_own_positions(inputs: dict, args: dict, mb) -> dict:
    """``inputs`` with the samples' own mRoPE positions where the model is a VLM (``args["vlm"]``), which computes
    its own (:func:`own_positions`) from the grids and the token types it is handed (``mm_token_type_ids``, which
    ``forward`` builds from the ids); handed grids without them it cannot (a transformers-5 model raises), so the
    model is then left without positions: the view says none were handed (INV-MM-001 asks for the token types), as
    OpenRLHF's adapter does; a text model's inputs unchanged."""
    grids = any(inputs.get(grid) is not None for _, grid in MEDIA_INPUT_KEYS.values())  # forward hands None without
    if args["vlm"] and (inputs.get(MEDIA_TOKEN_TYPES) is not None or not grids):
        inputs["position_ids"] = own_positions(mb).to(mb["input_ids"].device)
    return inputs
