"""Known-failure records of SkyRL (engines ``skyrl-train`` 0.3.1 and ``skyrl`` 0.4.0); spec/engines/skyrl/README.md and
docs/findings/F22, F23 reproduce the library's in plain torch.

``RECORDS`` are the library's (real differences from the contract), nothing else: 0.3.1, text only, is never drawn
mRoPE positions and 0.4.0's VLM is drawn them (and its images) padded only, where it takes them (their profiles'
``positions``, ``mrope_modes``); verl's int32 mask and untouched logits are verl's conventions (docs/contract.md),
asserted of no SkyRL engine.
"""

from __future__ import annotations


from ...protocol import OutputSpan, PaddedLayout
from ...protocol.known import KnownFailure
from ...protocol.profile import EngineProfile, Feature
from ..kit.records import LOW_PRECISION_LOGITS, MISMATCH, ORACLE_INVARIANTS, UNCLAMPED
from .config import SUPPORT_REPLAY, SWITCHES, TRAIN_SWITCHES

__all__ = ["REASONS", "RECORDS", "LIBRARY_RECORDS", "TRAIN_PROFILE", "PROFILE"]

IN_LOGITS_DTYPE = ("logprobs_from_logits_v2 takes a per-row F.log_softmax in the logits' dtype and chunked_entropy_from_logits "
                   "writes into a tensor of the logits' dtype: bf16/fp16 logits give bf16/fp16 log-probs and entropy "
                   "(0.003 nats off at V = 2); under the worker's torch.autocast(cuda, bf16) the log_softmax runs in float32 "
                   "but the entropy is still stored in bf16; library difference (F22)")
NO_CLAMP = ("forward divides the logits by its temperature as given (logits_BSV.div_(temperature)), with no 1e-8 clamp: "
            "T = 5e-9 doubles the log-probs of the clamped contract; library difference (F23)")
DTYPE = r"has dtype torch\.(bfloat16|float16), expected torch\.float32|" + MISMATCH

LIBRARY_RECORDS: tuple[KnownFailure, ...] = (
    # the adapter declares this precision (SkyRLTrainEngine.precision): the value checks judge at it, and most examples
    # then pass; some still fall outside the bf16 rounding rule (long rows, wide vocabularies): possible, not certain
    *(KnownFailure(inv, IN_LOGITS_DTYPE, matches=MISMATCH, when=LOW_PRECISION_LOGITS, certain=False) for inv in ORACLE_INVARIANTS),
    # sample-support replay scores bf16/fp16 logits in float32 (sample_support_scores): no dtype failure there
    KnownFailure("INV-DEV-001", IN_LOGITS_DTYPE, matches=DTYPE, when=LOW_PRECISION_LOGITS & ~SUPPORT_REPLAY),
    *(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv == "INV-TEMP-006")
      for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006")),
    KnownFailure("INV-SET-001", "HFModelWrapper takes sequence_parallel_size as given and reads it only as "
                 "'sequence_parallel_size > 1' (model_wrapper.py): 0 runs without sequence parallelism; SkyRL's "
                 "validate_cfg divides the world size by it before a worker is built (0: ZeroDivisionError); contract "
                 "difference (the wrapper alone does not check its setting), not a wrong value for valid settings",
                 raises=AssertionError,
                 matches=r"^AssertionError: engine settings \{'sp_size': 0, 'sp_rank': 0\} was accepted silently"),
)
RECORDS = LIBRARY_RECORDS


#: SkyRL's preparation the adapters run, whose lines and branches ``spec verify`` measures (the profile's surface,
#: spec/run/engine_coverage.py): the batch builder, HFModelWrapper.forward and the scoring helpers it calls
def _surface(collate: str, wrapper: str, torch_utils: str) -> tuple[str, ...]:
    return (f"{collate}:convert_prompts_responses_to_batch_tensors", f"{wrapper}:HFModelWrapper.forward",
            *(f"{torch_utils}:{f}" for f in ("logprobs_from_logits", "logprobs_from_logits_v2",
                                               "chunked_entropy_from_logits")))


TRAIN_SURFACE = _surface("skyrl_train.dataset.preprocess", "skyrl_train.model_wrapper", "skyrl_train.utils.torch_utils")
SURFACE = _surface("skyrl.train.dataset.preprocess", "skyrl.backends.skyrl_train.workers.model_wrapper",
                   "skyrl.backends.skyrl_train.utils.torch_utils")

#: branches of the surfaces no CPU run of the suite reaches, each with its reason (a ``gap:`` reason names the input
#: a real trainer sends that the case space does not draw yet)
_RAISE = {"*:raise": "an error path: SkyRL raises for an input it rejects; the suite's valid cases never take it"}
_FLASH_CE = "needs flash-attn's Triton cross-entropy (a CUDA build of flash-attn; FLASH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE)"
_SEVERAL_ACTIONS = ("an error path: num_actions as a list of several counts becomes a NumPy array, which the slice "
                    "log_probs[:, -num_actions - 1:-1] rejects (TypeError: only integer scalar arrays can be converted "
                    "to a scalar index); the list of one count is drawn (config.py, num_actions_list)")
TRAIN_UNREACHABLE: dict[str, str] = {
    **_RAISE,
    "skyrl_train.model_wrapper:385->388": _SEVERAL_ACTIONS, "skyrl_train.utils.torch_utils:136->137": _FLASH_CE,
}
_WRAPPER, _PREPROCESS = "skyrl.backends.skyrl_train.workers.model_wrapper", "skyrl.train.dataset.preprocess"
UNREACHABLE: dict[str, str] = {
    **_RAISE,
    f"{_WRAPPER}:470->473": _SEVERAL_ACTIONS, "skyrl.backends.skyrl_train.utils.torch_utils:137->138": _FLASH_CE,
}
#: what 0.4.0's batch builder refuses (INV-FLAG-004/005 hand it each): routed experts of fewer trajectories than the
#: batch (ValueError 'rollout_expert_indices must contain routes for every trajectory')
REFUSES = {"routes_misaligned": "convert_prompts_responses_to_batch_tensors raises ValueError('rollout_expert_indices "
                                "must contain routes for every trajectory')"}

#: survivors of ``spec mutate --engine skyrl-train`` that no input tells from SkyRL's code, each with why (by id)
_SP_ONE = ("with sequence_parallel_size == 1 ulysses_pad_and_slice_inputs returns its inputs as they are (sp_size <= 1) "
           "with a pad of 0, and the packed mask it sets to None is None already; the gather after it still tests > 1")
_INT64 = "torch.tensor of lists of Python ints is int64 already: dtype=torch.int64 changes nothing"
_BOTH_LOG_SOFTMAX = ("both branches take log_softmax at the label (a gather minus a per-row logsumexp, or a per-row "
                     "log_softmax then a gather) in the logits' dtype: the same log-probs up to rounding")
_ENTROPY_FLOAT32 = ("the entropy is stored in float32 (torch's default) for the logits' dtype: the same values, computed "
                    "in the logits' dtype; float32 is the contract's own dtype, so no consumer can be hurt (F22 records "
                    "bf16/fp16)")
_PAD_POSITION = ("the position of a padding column stays cumsum - 1 (-1 or the last real position) instead of 1: "
                 "packed, unpad_input drops those columns; padded, the attention mask hides them as keys, and a RoPE "
                 "model's output at a real token does not read its own padding columns' positions; no output is read "
                 "at a padding column")
_EXTRA_CHUNK = ("(L + 1025) // 1024 chunks for (L + 1023) // 1024: the extra chunk starts at L, an empty slice that "
                "writes nothing")
TRAIN_EQUIVALENT_MUTANTS: dict[str, str] = {
    "skyrl_train.utils.torch_utils:logprobs_from_logits_v2:164 branch: condition negated": _BOTH_LOG_SOFTMAX,
    "skyrl_train.dataset.preprocess:convert_prompts_responses_to_batch_tensors:109 dtype: dtype= dropped": _INT64,
    "skyrl_train.dataset.preprocess:convert_prompts_responses_to_batch_tensors:110 dtype: dtype= dropped": _INT64,
    "skyrl_train.model_wrapper:HFModelWrapper.forward:311 compare: Gt -> GtE": _SP_ONE,
    "skyrl_train.model_wrapper:HFModelWrapper.forward:325 compare: Eq -> NotEq":
        "packed, attention_mask_fwd is None already: both model calls hand the model the same inputs",
    "skyrl_train.model_wrapper:HFModelWrapper.forward:311 branch: condition negated": _SP_ONE,
    "skyrl_train.dataset.preprocess:convert_prompts_responses_to_batch_tensors:130 dtype: dtype= dropped":
        "torch.tensor of lists of Python floats is float32 (torch's default dtype) already: dtype=torch.float changes "
        "nothing",
    "skyrl_train.dataset.preprocess:convert_prompts_responses_to_batch_tensors:113 dtype: dtype= dropped":
        "the loss masks come out int64 (the action mask's dtype) with the same values: the generator's loss masks are "
        "0/1 ints (GeneratorOutput.loss_masks: List[List[int]]), and every consumer multiplies or sums them with "
        "float tensors (masked_mean, the advantage estimators), which gives the same floats",
    "skyrl_train.utils.torch_utils:chunked_entropy_from_logits:91 arith: Sub -> Add": _EXTRA_CHUNK,
    "skyrl_train.utils.torch_utils:chunked_entropy_from_logits:92 dtype: dtype= dropped": _ENTROPY_FLOAT32,
    "skyrl_train.model_wrapper:HFModelWrapper.forward:291 cast: .long() removed":
        "the batch builder's attention mask is int64 already (torch.tensor(..., dtype=torch.int64)): .long() is a "
        "no-op, and its cumsum is int64 either way",
    "skyrl_train.model_wrapper:HFModelWrapper.forward:292 inplace: .masked_fill_ -> .masked_fill": _PAD_POSITION,
    "skyrl_train.model_wrapper:HFModelWrapper.forward:361 branch: condition negated":
        "the entropy at padding columns is not multiplied by the attention mask (padded), packed the mask is None "
        "either way: the entropy at a real token is the same, and no consumer reads it at a padding column "
        "(every consumer masks by the response mask)",
}

#: survivors of ``spec mutate --engine skyrl`` (0.4.0) that no input tells from SkyRL's code, each with why (by id)
_W4, _P4 = f"{_WRAPPER}:HFModelWrapper.forward", f"{_PREPROCESS}:convert_prompts_responses_to_batch_tensors"
_TU4 = "skyrl.backends.skyrl_train.utils.torch_utils"
_LOGGED = ("max_seq_len only decides whether a warning is logged (\"No truncation is performed\"): the batch is the "
           "same either way")
EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_P4}:337 compare: Gt -> GtE": _LOGGED,
    f"{_P4}:337 branch: condition negated": _LOGGED,
    f"{_P4}:346 dtype: dtype= dropped": "np.asarray of a list of Python ints (the prompts' lengths) is int64 already "
                                        "on the platforms SkyRL runs on (Linux x86-64, aarch64): dtype=np.int64 "
                                        "changes nothing",
    f"{_P4}:347 dtype: dtype= dropped": "np.asarray of a list of Python ints (the responses' lengths) is int64 "
                                        "already on the platforms SkyRL runs on (Linux x86-64, aarch64): "
                                        "dtype=np.int64 changes nothing",
    f"{_P4}:352 dtype: dtype= dropped": "np.full with a Python int fill (the pad id) is int64 already on the platforms "
                                        "SkyRL runs on (Linux x86-64, aarch64): dtype=np.int64 changes nothing",
    f"{_P4}:360 dtype: dtype= dropped": "np.arange of an int is int64 already on the platforms SkyRL runs on (Linux "
                                        "x86-64, aarch64): dtype=np.int64 changes nothing",
    f"{_P4}:364 dtype: dtype= dropped": "np.arange of an int is int64 already on the platforms SkyRL runs on (Linux "
                                        "x86-64, aarch64): dtype=np.int64 changes nothing",
    f"{_W4}:345 cast: .long() removed": "the batch builder's attention mask is int64 already "
                                        "(torch.from_numpy of an int64 array): .long() is a no-op",
    f"{_W4}:369 compare: Gt -> GtE": _SP_ONE,
    f"{_W4}:346 inplace: .masked_fill_ -> .masked_fill": _PAD_POSITION,
    f"{_W4}:405 compare: Eq -> NotEq": "packed, attention_mask_fwd is None already (set so where the rows are "
                                       "unpadded, whatever the attention implementation): both model calls hand the "
                                       "model the same inputs; unpacked, remove_microbatch_padding is False either way",
    f"{_TU4}:logprobs_from_logits_v2:165 branch: condition negated": _BOTH_LOG_SOFTMAX,
    f"{_TU4}:chunked_entropy_from_logits:91 arith: Sub -> Add": _EXTRA_CHUNK,
    f"{_TU4}:chunked_entropy_from_logits:92 dtype: dtype= dropped": _ENTROPY_FLOAT32,
}

#: the adapters' profiles: skyrl-train (0.3.1) left-pads prompts and right-pads responses, skyrl (0.4.0) left-pads
#: whole rows (outputs right-aligned in (B, max r_i)); 0.3.1 has no VLM path (1-D positions), 0.4.0's VLM (mRoPE
#: positions, images) refuses packing
#: (both: log_probs[:, -num_actions - 1:-1], the positions that score a response token)
TRAIN_PROFILE = EngineProfile(padded_layouts=(PaddedLayout.LEFT_RIGHT,), positions=("rope",), surface=TRAIN_SURFACE,
                              unreachable=TRAIN_UNREACHABLE, equivalent_mutants=TRAIN_EQUIVALENT_MUTANTS,
                              output_span=OutputSpan.RESPONSE, config_space=TRAIN_SWITCHES)  # skyrl/config.py
PROFILE = EngineProfile(padded_layouts=(PaddedLayout.LEFT,), positions=("rope", "mrope"), media=("image",),
                        mrope_modes=("padded",), surface=SURFACE, unreachable=UNREACHABLE, refuses=REFUSES,
                        equivalent_mutants=EQUIVALENT_MUTANTS,
                        output_span=OutputSpan.RESPONSE, config_space=SWITCHES)  # skyrl/config.py

#: why the engine lacks each feature it does not offer (the kit's ThirdPartyEngine.reasons)
REASONS = {
    Feature.VALUE: "the critic is another model class (get_llm_for_sequence_regression), not HFModelWrapper",
    Feature.TEMPERATURE_HANDOFF: "one float temperature per forward call; nothing is handed over",
    Feature.CU_SEQLENS: "the unpadded path hands the model no cu_seqlens (flash-attn finds them from positions)",
    Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per forward call (the sampling temperature)",
}
