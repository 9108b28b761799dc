"""verl's preparation code as its profile declares it (``EngineProfile.surface`` and what goes with it): what ``spec
verify`` measures of verl's FSDP engine (its ``prepare_model_inputs``/``prepare_model_outputs``, the helpers they call,
the micro-batch layer every verl engine shares), the branches no CPU run reaches and the functions the preparation
never passes through, each with its reason, and the settings the engine refuses (INV-FLAG-004/005). Plain data: the
lines are verl 0.9.1's.
"""

from __future__ import annotations

__all__ = ["VERL_LOGITS_HELPERS", "VERL_HELPERS", "VERL_LAYER", "VERL_SURFACE", "NO_DTENSOR", "VERL_LAYER_UNREACHABLE",
           "VERL_LOGITS_UNREACHABLE", "VERL_UNREACHABLE", "VERL_LAYER_OFF_PATH", "VERL_OFF_PATH", "VERL_REFUSES"]

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_SB, _TU, _EU = "verl.utils.seqlen_balancing", "verl.utils.tensordict_utils", "verl.workers.engine.utils"


#: verl.utils.torch_functional's log-prob helpers: all of verl's helpers that the native engines (torchtitan's,
#: automodel's) call
VERL_LOGITS_HELPERS = tuple(f"verl.utils.torch_functional:{f}" for f in (
    "logprobs_from_logits", "logprobs_from_logits_v2", "entropy_from_logits", "entropy_from_logits_with_chunking",
    "calculate_sum_pi_squared_from_logits", "expand_as_nested"))


#: what verl's engines call of verl's helpers around prepare_model_inputs / prepare_model_outputs
VERL_HELPERS = (
    "verl.workers.utils.padding",
    *VERL_LOGITS_HELPERS,
    *(f"verl.utils.ulysses:{f}" for f in ("slice_input_tensor", "gather_outputs_and_unpad", "ulysses_pad",
                                          "ulysses_pad_and_slice_inputs", "_pad_tensor", "_unpad_tensor")),
)


#: verl's micro-batch layer (every verl engine's forward_backward_batch) and the TensorDict helpers it calls
VERL_LAYER = (
    *(f"verl.workers.engine.utils:{f}" for f in ("prepare_micro_batches", "postprocess_batch_func")),
    *(f"verl.utils.seqlen_balancing:{f}" for f in ("calculate_workload", "karmarkar_karp",
                                                   "get_seqlen_balanced_partitions", "ceildiv", "roundup_divisible",
                                                   "rearrange_micro_batches", "get_reverse_idx",
                                                   "restore_dynamic_batch")),
    *(f"verl.utils.tensordict_utils:{f}" for f in ("get_non_tensor_data", "unwrap_non_tensor_data",
                                                   "chunk_tensordict", "concat_tensordict",
                                                   "concat_tensordict_with_none_bsz", "index_select_tensor_dict",
                                                   "concat_nested_tensors", "nested_tensor_from_tensor_list",
                                                   "list_of_dict_to_tensordict", "maybe_fix_3d_position_ids")),
)


#: verl's FSDP engine: its preparation, the helpers it calls, the micro-batch layer
VERL_SURFACE = (
    f"{_FSDP}:FSDPEngine._get_packed_pad_size", f"{_FSDP}:FSDPEngine._gather_and_unpad_packed",
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_inputs", f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_outputs",
    f"{_FSDP}:FSDPEngineWithValueHead.prepare_model_outputs", "verl.workers.engine.utils:pad_packed_inputs",
    *VERL_HELPERS, *VERL_LAYER,
)


#: branches of VERL_SURFACE no CPU run of the suite can reach (verl 0.9.1's lines), each with its reason
#: (a ``gap:`` reason is no such reason: an input a real trainer sends that the case space does not draw yet)
NO_DTENSOR = "needs a tensor-parallel device mesh: DTensor logits sharded on the vocabulary (full_tensor() first)"


_DEAD_PAD_MODE = ("dead code: the assert at the top of prepare_model_inputs refuses any pad_mode but no_padding "
                  "first (INV-FLAG-004/005 hand it left_right and right)")


#: those of the micro-batch layer (every verl engine's)
VERL_LAYER_UNREACHABLE: dict[str, str] = {
    "*:raise": "an error path: verl raises for an input it rejects; the suite's valid cases never take it (the "
               "settings its profile refuses are handed to it by INV-FLAG-004/005)",
    f"{_EU}:192->196": "dead code: the assert at the top of postprocess_batch_func refuses any pad_mode but "
                       "no_padding first (INV-FLAG-004 hands it left_right and right)",
    f"{_TU}:360": "torch 2.13's unbind splits every jagged layout the layer holds (2-D ids, mRoPE ragged at 2 or at 1, "
                  "teacher top-K, routed experts, offsets with holes): the fallback for pytorch#153238's unbind "
                  "error runs on older torch only",
}


#: those of verl.utils.torch_functional's log-prob helpers
VERL_LOGITS_UNREACHABLE: dict[str, str] = {
    "verl.utils.torch_functional:96->97": "needs flash-attn's Triton cross-entropy (a CUDA build of flash-attn)",
    "verl.utils.torch_functional:103->104": "needs an Ascend NPU (torch_npu's cross-entropy)",
}


VERL_UNREACHABLE: dict[str, str] = {
    **VERL_LAYER_UNREACHABLE, **VERL_LOGITS_UNREACHABLE,
    f"{_FSDP}:1190->1198": _DEAD_PAD_MODE, f"{_FSDP}:1275->1312": _DEAD_PAD_MODE,
    f"{_EU}:78->79": "the engine calls pad_packed_inputs only when _get_packed_pad_size returned a positive pad",
    f"{_FSDP}:1384->1385": NO_DTENSOR, f"{_FSDP}:1481->1482": NO_DTENSOR,
    "verl.utils.ulysses:271->272": "the engine gathers only under sequence parallelism, where the Ulysses group is set",
    "verl.utils.ulysses:274->279": "every caller in the engine passes unpad_dim",
    "verl.utils.ulysses:288->289": "the engine pads for Ulysses only with sp_size > 1 (ulysses_pad_and_slice_inputs)",
}


#: functions inside VERL_SURFACE's entries the preparation never passes through (not counted, listed with why):
#: VERL_LAYER_OFF_PATH those of the micro-batch layer (every verl engine's)
VERL_LAYER_OFF_PATH: dict[str, str] = {
    f"{_SB}:karmarkar_karp.<locals>.State.__repr__": "a debugging repr: nothing in the preparation or the balance "
                                                     "prints a State",
}


VERL_OFF_PATH: dict[str, str] = {
    "verl.workers.utils.padding:embeds_padding_2_no_padding": "no caller in verl 0.9.1's LM/value engines, their "
                                                              "micro-batch layer or trainer (the embedding-input "
                                                              "models' helper)",
    **VERL_LAYER_OFF_PATH,
}


#: settings verl's FSDP engine does not support (INV-FLAG-004/005 assert it raises for each)
VERL_REFUSES: dict[str, str] = {
    "pad_mode": "the FSDP engine's preparation and postprocess_batch_func implement pad_mode no_padding only "
                "(NotImplementedError / an assertion otherwise)",
    "sum_pi_squared_fused": "fused kernels do not materialise the logits that sum_pi_squared needs (NotImplementedError)",
    "bucket_distillation": "the teacher tensors are sliced by the Ulysses pad rule, which knows no static pad "
                           "(RuntimeError)",
}
