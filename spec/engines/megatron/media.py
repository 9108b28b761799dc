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

from functools import partial
from types import SimpleNamespace
from typing import Any
from unittest import mock

from ...protocol.engine import read_flags
from ...truth.megatron_packing import PackSpec
from ..kit import inputs_seen_by_model
from ..kit.stubs import import_verl_module
from ..verl.media import VERL_MM_SURFACE, VERL_MM_UNREACHABLE, VERL_VARLEN_UNREACHABLE

__all__ = ["MegatronVisionForward", "MEGATRON_MM_SURFACE", "MEGATRON_MM_UNREACHABLE"]

IMPL = "verl.workers.engine.megatron.transformer_impl"
_U = "verl.models.mcore.util"
#: what the vision-language path runs of verl before the model call
MEGATRON_MM_SURFACE = (f"{IMPL}:MegatronEngineWithLMHead.prepare_model_inputs", f"{_U}:build_vlm_attn_mask_thd",
                       f"{_U}:build_vlm_attn_mask_bshd", *VERL_MM_SURFACE)
MEGATRON_MM_UNREACHABLE: dict[str, str] = {
    **VERL_MM_UNREACHABLE, **VERL_VARLEN_UNREACHABLE,
    f"{_U}:895->896": "needs an Ascend NPU (is_npu_available: the VLM BSHD path hands no attention mask there)",
}


class _Model:
    """The model ``gptmodel_forward_model_engine`` is handed: what ``unwrap_model`` reads, and the recorder."""

    def __init__(self, record: Any, spec: PackSpec):
        self.record, self.pre_process, self.post_process = record, True, True
        self.config = SimpleNamespace(fp8="e4m3" if spec.fp8 else None)

    def __call__(self, **kwargs: Any) -> Any:
        return self.record(**kwargs)


def _engine_self(impl: Any, micro_batch: Any, *, packed: bool) -> SimpleNamespace:
    """What ``forward_step`` reads of its engine object before the model call (the module docstring)."""
    cls = impl.MegatronEngineWithLMHead
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(use_fused_kernels=False, pad_to_length=False, pad_to_length_bucket=None,
                                      use_remove_padding=packed, dynamic_context_parallel=False),
        enable_routing_replay=False, _get_context_parallel_layout=cls._get_context_parallel_layout,
        model_config=SimpleNamespace(
            hf_config=SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration"], vision_config={}),
            tokenizer=SimpleNamespace(pad_token_id=read_flags(micro_batch)["pad_token_id"]),
            mtp=SimpleNamespace(enable=False)))
    engine.prepare_model_inputs = partial(cls.prepare_model_inputs, engine)
    engine._lm_head_logits_processor = partial(cls._lm_head_logits_processor, engine)
    return engine


class MegatronVisionForward:
    """``MegatronEngineWithLMHead.forward_step`` on one CP rank's micro-batch, up to the model call."""

    def __init__(self) -> None:
        self.impl = import_verl_module("verl-megatron", IMPL, ("megatron",))[1].module

    def handed(self, micro_batch: Any, spec: PackSpec, rank: int, rank_context: Any, *, packed: bool) -> dict:
        """The model's keyword arguments as ``forward_step`` builds them (``rank_context``: the packer's fake
        parallel state for ``spec`` and ``rank``); ``cu_seqlens_padded`` from its ``packed_seq_params`` (THD)."""
        engine = _engine_self(self.impl, micro_batch, packed=packed)
        step = self.impl.MegatronEngineWithLMHead.forward_step
        with rank_context(spec, rank), mock.patch.object(self.impl, "get_device_id", lambda: "cpu"):
            handed = inputs_seen_by_model(lambda record: step(engine, iter([micro_batch]), _Model(record, spec),
                                                              None, None))
        params = handed.pop("packed_seq_params", None)
        if params is not None:
            handed["cu_seqlens_padded"] = params.cu_seqlens_q_padded
        return handed
