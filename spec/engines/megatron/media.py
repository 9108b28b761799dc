"""verl 0.9.1's Megatron engine on a vision-language micro-batch (issue 50): what its own forward hands the model.

``MegatronEngineWithLMHead.forward_step`` (transformer_impl.py) runs ``prepare_model_inputs`` (its
``extract_multi_modal_inputs`` of the micro-batch's ``multi_modal_inputs``) and, for a model config with a
``vision_config`` (``vision_model=True``), ``gptmodel_forward_model_engine`` (model_forward.py): the media moved
beside the ids as ``pixel_values`` / ``image_grid_thw`` / the video keys (lines 291-299), the THD boundaries of
``preprocess_thd_engine``, and the ids as rows with a mask (``build_vlm_attn_mask_thd`` line 350, BSHD
``build_vlm_attn_mask_bshd`` line 447), handed to the model at line 355 (BSHD 453). The model packs for itself:
mbridge's vision-language model embeds the rows, places the features at the image tokens, computes its mRoPE index
from the ids and grids, and packs the combined embeddings with the handed boundaries. :class:`MegatronVisionForward` runs
``forward_step`` itself up to that call (:func:`~spec.engines.kit.inputs_seen_by_model`).

The seams, each what a real run's setup fills: the engine object's configuration (a namespace with what
``forward_step`` reads before the model call: ``use_remove_padding`` for the data format, no fused kernels, no
router replay, no MTP, no dynamic CP, no bucket; the tokenizer's pad id the micro-batch's; a Qwen2.5-VL config with a
``vision_config``), megatron's parallel state (the packer's fake) and ``get_device_id`` (the CPU). The model is a
recorder with what ``unwrap_model`` reads (``pre_process``, ``post_process``, ``config.fp8``).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from ...truth.megatron_packing import PackSpec
from ..kit import inputs_seen_by_model
from ..kit.stubs import import_verl_module
from .engine import IMPL, MegatronModel, engine_namespace
from ..verl.media import VERL_MM_SURFACE, VERL_MM_UNREACHABLE, VERL_VARLEN_UNREACHABLE

__all__ = ["MegatronVisionForward", "MEGATRON_MM_SURFACE", "MEGATRON_MM_UNREACHABLE"]

_U = "verl.models.mcore.util"
#: what the vision-language path runs of verl before the model call
MEGATRON_MM_SURFACE = (f"{IMPL}:MegatronEngineWithLMHead.prepare_model_inputs", f"{_U}:build_vlm_attn_mask_thd",
                       f"{_U}:build_vlm_attn_mask_bshd", *VERL_MM_SURFACE)
MEGATRON_MM_UNREACHABLE: dict[str, str] = {
    **VERL_MM_UNREACHABLE, **VERL_VARLEN_UNREACHABLE,
    f"{_U}:895->896": "needs an Ascend NPU (is_npu_available: the VLM BSHD path hands no attention mask there)",
}


class MegatronVisionForward:
    """``MegatronEngineWithLMHead.forward_step`` on one CP rank's micro-batch, up to the model call."""

    def __init__(self) -> None:
        self.impl = import_verl_module("verl-megatron", IMPL, ("megatron",))[1].module

    def handed(self, micro_batch: Any, spec: PackSpec, rank: int, rank_context: Any, *, packed: bool) -> dict:
        """The model's keyword arguments as ``forward_step`` builds them (``rank_context``: the packer's fake
        parallel state for ``spec`` and ``rank``); ``cu_seqlens_padded`` from its ``packed_seq_params`` (THD)."""
        engine = engine_namespace(self.impl, micro_batch, packed=packed, vision=True)
        step = self.impl.MegatronEngineWithLMHead.forward_step
        with rank_context(spec, rank), mock.patch.object(self.impl, "get_device_id", lambda: "cpu"):
            handed = inputs_seen_by_model(lambda record: step(engine, iter([micro_batch]), MegatronModel(record, spec),
                                                              None, None))
        params = handed.pop("packed_seq_params", None)
        if params is not None:
            handed["cu_seqlens_padded"] = params.cu_seqlens_q_padded
        return handed
