"""verl's FSDP engine's profile as data (:data:`PROFILE`, verl 0.9.1's; :func:`release_profile`, the installed
release's): the preparation code ``spec verify`` measures (its ``prepare_model_inputs``/``prepare_model_outputs``, the
helpers they call, the micro-batch layer every verl engine shares), the branches no CPU run reaches and the functions
the preparation never passes through, each with its reason, the settings the engine refuses (INV-FLAG-004/005), the
switches of its own configuration the strategies draw (:data:`VERL_CONFIG_SPACE`) and the conventions it keeps. The
lines are verl 0.9.1's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...protocol.profile import DEFAULT_PROFILE, MEDIA, VERL_CONVENTIONS, ConfigSwitch, Convention, EngineProfile
from ...truth.oracle import LOG_PROB_MIN_CLAMP
from .media import VERL_MM_SURFACE, VERL_MM_UNREACHABLE
from .mutants import VERL_EQUIVALENT_MUTANTS

__all__ = ["VERL_LOGITS_HELPERS", "VERL_HELPERS", "VERL_LAYER", "VERL_SURFACE", "NO_DTENSOR", "VERL_LAYER_UNREACHABLE",
           "VERL_LOGITS_UNREACHABLE", "VERL_UNREACHABLE", "VERL_LAYER_OFF_PATH", "VERL_OFF_PATH", "VERL_REFUSES",
           "VERL_CONFIG_SPACE", "PROCESSOR_SWITCHES", "PROFILE", "release_profile"]

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_SB, _TU, _EU = "verl.utils.seqlen_balancing", "verl.utils.tensordict_utils", "verl.workers.engine.utils"


#: verl.utils.torch_functional's log-prob helpers the FSDP engine calls (the native engines, torchtitan's and
#: automodel's, all but calculate_sum_pi_squared_from_logits: spec/engines/verl/native.py)
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
    f"{_EU}:78->79": "dead code in verl 0.9.1: pad_packed_inputs' only caller, the FSDP engine's prepare_model_inputs "
                     "(transformer_impl.py:1208), calls it under `if static_pad_size:` with _get_packed_pad_size's "
                     "pad, never negative",
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


#: every switch the FSDP engine's ``prepare_model_inputs``/``prepare_model_outputs`` read (installed code:
#: ``verl/workers/engine/fsdp/transformer_impl.py`` and ``verl/utils/torch_functional.py``), and those of verl's own

#: every verl engine's ``engine_config.entropy_checkpointing`` (FSDP's, and the native engines': spec/engines/verl/native.py)
ENTROPY_CHECKPOINTING = ConfigSwitch(
    "entropy_checkpointing", (False, True),
    "engine_config.entropy_checkpointing: the entropy under torch.utils.checkpoint (both modes; with chunking on, the "
    "chunked function at its default chunk of 2048)")

#: top-K processor
VERL_CONFIG_SPACE: tuple[ConfigSwitch, ...] = (
        ENTROPY_CHECKPOINTING,
        ConfigSwitch("entropy_from_logits_with_chunking", setting="entropy_chunk_size", needs=("chunking",),
                     text="engine_config.entropy_from_logits_with_chunking: the packed entropy by "
                          "entropy_from_logits_with_chunking (float32 chunks), on when entropy_chunk_size is set"),
        ConfigSwitch("entropy_from_logits_chunk_size", setting="entropy_chunk_size", needs=("chunking",),
                     text="engine_config.entropy_from_logits_chunk_size: the chunk's rows"),
        ConfigSwitch("pad_to_length_bucket", setting="pad_to_length", needs=("bucket",),
                     text="engine_config.pad_to_length / pad_to_length_bucket: the static packed bucket"),
        ConfigSwitch("pass_packed_cu_seqlens", setting="pass_cu_seqlens", needs=("cu_seqlens",),
                     text="cu_seqlens handed to a model whose forward takes them"),
        ConfigSwitch("v_head", (False, True), needs=("value",),
                     text="a value model with a v_head (trl's AutoModelForCausalLMWithValueHead: values are "
                          "output[2]) instead of a token classifier (values are output.logits.squeeze(-1))"),
        ConfigSwitch("use_chunked_topk", (False, True), needs=("distillation",),
                     text="distillation.distillation_loss.use_chunked_topk: verl's own top-K processor streams "
                          "logsumexp and gather over chunks of tokens in float32 (_chunked_topk_log_probs) and "
                          "ranks the student's top-K on the logits, instead of one log_softmax"),
        ConfigSwitch("chunked_topk_chunk_size", (4096, 1, 2, 3, 7), needs=("distillation",),
                     text="distillation.distillation_loss.chunked_topk_chunk_size: the chunk's tokens (verl's "
                          "default 4096 first; 1, 2, 3, 7 leave a short last chunk on the suite's rows)"),
        ConfigSwitch(LOG_PROB_MIN_CLAMP, (None, -10.0, -1.0), needs=("distillation",),
                     text="distillation.distillation_loss.log_prob_min_clamp: both top-K log-probs clamped below "
                          "before the KL terms (verl's default is -10.0; the suite shrinks to None, no clamp; "
                          "-1.0 clamps most tokens); the oracle computes it (spec.truth.oracle.topk_terms)"),
        ConfigSwitch("use_torch_compile", (False,), unseen={True: (
            "engine_config.use_torch_compile wraps entropy_from_logits in torch.compile(dynamic=True): a compile "
            "per new shape, seconds each on 2 CPU cores; not drawn")},
            text="engine_config.use_torch_compile: the entropy function compiled"),
        ConfigSwitch("flash_attn_cross_entropy", (False,), unseen={True: (
            "logprobs_from_logits takes flash-attn's Triton cross entropy when flash-attn is installed: CUDA only, "
            "not installed here")}, text="the log-prob kernel"),
        ConfigSwitch("tensor_parallel_logits", (False,), unseen={True: (
            "DTensor logits sharded on the vocabulary (full_tensor() first) need a tensor-parallel device mesh")},
            text="logits as a DTensor"),
)
#: the switches of :data:`VERL_CONFIG_SPACE` that configure verl's own top-K processor (DistillationLossConfig)
PROCESSOR_SWITCHES = ("use_chunked_topk", "chunked_topk_chunk_size", LOG_PROB_MIN_CLAMP)

#: verl 0.9.1's FSDP engine: the preparation code spec verify measures (spec.run.engine_coverage), what it refuses,
#: its configuration space and verl's conventions
PROFILE = replace(DEFAULT_PROFILE, surface=VERL_SURFACE + VERL_MM_SURFACE,
                  unreachable={**VERL_UNREACHABLE, **VERL_MM_UNREACHABLE}, off_path=VERL_OFF_PATH,
                  conventions=VERL_CONVENTIONS, refuses=VERL_REFUSES, equivalent_mutants=VERL_EQUIVALENT_MUTANTS,
                  config_space=VERL_CONFIG_SPACE, media=MEDIA)  # images, videos, audio: spec/engines/verl/media.py


def release_profile(profile: EngineProfile, caps: Any) -> EngineProfile:
    """``profile`` as the installed release (``caps``, its probe) has it: a release that divides the logits in place
    (verl 0.7.1, before ``_scale_logits_by_temperature``) does not keep the ``LOGITS_UNTOUCHED`` convention; a release
    whose ``extract_multi_modal_inputs`` concatenates an audio model's features as they are (verl 0.7.1, before
    ``_VARLEN_MULTI_MODAL_KEYS``) takes no audio micro-batch: samples' clips of unequal widths raise ``RuntimeError:
    Sizes of tensors must match`` there (docs/verl-differences.md), so its profile lists images and videos only."""
    if not caps.logits_untouched:
        profile = replace(profile, conventions=profile.conventions - {Convention.LOGITS_UNTOUCHED})
    if not getattr(caps, "pads_audio", True):
        profile = replace(profile, media=tuple(kind for kind in profile.media if kind != "audio"))
    return profile
