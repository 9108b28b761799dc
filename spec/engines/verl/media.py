"""verl 0.9.1's multi-modal preparation (issue 50): what its FSDP engine calls for a vision-language or an audio
micro-batch, on its coverage surface, and the branches of it no drawn image, video or audio clip reaches, each with
its reason. An audio model's clips (``input_features``, ``feature_attention_mask``: ``_VARLEN_MULTI_MODAL_KEYS``) are
padded on their last dimension to the longest sample's frames (``_pad_last_dim_and_cat``); the engines that hand the
micro-batch's ``multi_modal_inputs`` to the model as they extract them (FSDP, VeOmni, TorchTitan, Automodel) draw
them (their profiles' ``media``), the Megatron engine does not (:data:`VERL_VARLEN_UNREACHABLE`).

``FSDPEngineWithLMHead.prepare_model_inputs`` calls ``verl.utils.model.extract_multi_modal_inputs`` on every
micro-batch (transformer_impl.py line 1168) and hands its result to the model in both modes; under Ulysses sequence
parallelism a vision model's ids are padded, not sliced (``is_vlm_model``: the adapter's stand-in module config has
a ``vision_config`` for mRoPE cases, spec/engines/verl/adapter.py).
"""

from __future__ import annotations

__all__ = ["VERL_MM_SURFACE", "VERL_MM_UNREACHABLE", "VERL_VARLEN_UNREACHABLE"]

_MODEL = "verl.utils.model"
#: what the preparation calls of verl's multi-modal helpers
VERL_MM_SURFACE = (f"{_MODEL}:extract_multi_modal_inputs", f"{_MODEL}:_pad_last_dim_and_cat")
_VARLEN = ("another model family's configuration: an audio model's variable-length keys (_VARLEN_MULTI_MODAL_KEYS: "
           "input_features and feature_attention_mask of Qwen2-Audio / Qwen2.5-Omni), which verl's Megatron forward "
           "never hands a model (gptmodel_forward_model_engine passes pixel_values, image_grid_thw and the video "
           "keys only, model_forward.py lines 291-299; mbridge builds no audio model)")
#: the branches of VERL_MM_SURFACE only an audio micro-batch reaches (its clips' features and masks, padded to the
#: longest sample's frames): declared for an engine that draws no audio (its profile's media)
VERL_VARLEN_UNREACHABLE: dict[str, str] = {f"{_MODEL}:_pad_last_dim_and_cat": _VARLEN, f"{_MODEL}:798->801": _VARLEN}
#: the branches of VERL_MM_SURFACE no drawn image, video or audio clip reaches (verl 0.9.1's lines)
VERL_MM_UNREACHABLE: dict[str, str] = {
    f"{_MODEL}:779->780": "dead code in verl 0.9.1: no caller of extract_multi_modal_inputs passes indices (the "
                          "FSDP/VeOmni engines' prepare_model_inputs, transformer_impl.py:1168, and Megatron's, "
                          "TorchTitan's and Automodel's: each hands the micro-batch's whole list)",
    f"{_MODEL}:787->788": "needs MiniCPM-o's image_bound key (another model family's processor output; its "
                          "per-sample lists are handed as lists, not concatenated)",
    f"{_MODEL}:796->797": "needs MiniCPM-o's image_bound key, as 787",
}
