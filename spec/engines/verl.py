"""verl's FSDP engines as an engine under test (``--engine verl``).

Builds ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead`` /
``FSDPEngineWithValueHead`` without their constructor (no model, no process group,
no device mesh): only the attributes that ``prepare_model_inputs`` and
``prepare_model_outputs`` read are set. Nothing of verl's code is copied here; the
adapter sets attributes and adapts the calling convention, nothing else.

What the installed verl *has* is probed (signatures, attributes, module members), not
read off its version string:

* ``prepare_model_outputs(..., logits_processor_func)``: verl 0.9 takes the top-K
  distillation processor as a 4th positional argument; verl 0.7.1 has no such parameter
  and no distillation.
* ``FSDPEngine._get_packed_pad_size``: the static bucket (``pad_to_length`` /
  ``pad_to_length_bucket`` engine attributes).
* whether ``prepare_model_outputs`` reads the ``calculate_sum_pi_squared`` flag at all
  (verl 0.7.1 ships ``calculate_sum_pi_squared_from_logits`` but its engine never reads
  the flag).
* ``verl.workers.utils.padding.<helper>``, and whether ``verl.utils.attention_utils`` works
  without flash-attn (verl 0.7.1's does not, so its ``left_right_2_no_padding`` cannot run
  on CPU).

What is known to be *wrong* in a verl release is a fact about that release, so
:data:`KNOWN_BUGS` is keyed by version (plus ``"*"`` for every version): a new release
gets no excuse it has not earned, and a fixed bug shows up as "unexpectedly passed".
Each entry has a minimal counterexample in ``docs/verl-conformance.md``.

Sequence parallelism runs on real ranks (:mod:`spec.execute.ranks`): verl's Ulysses path slices and
all-gathers through a ``torch.distributed`` process group (``verl.utils.ulysses``), so an
``sp > 1`` engine object is built with ``use_ulysses_sp=True``, ``ulysses_sequence_parallel_size``
and ``ulysses_parallel_group`` (the group is read off the ``all_gather`` the suite hands every
engine: :class:`impl.sequence_parallel.TorchDistributedAllGather` has it), and verl's module-level
Ulysses group is set around each call the way verl's ``EngineEvalModeCtx``/``EngineTrainModeCtx``
set it. The harness sends every ``sp > 1`` case of this engine to the real ranks
(:attr:`VerlEngine.sp_on_real_ranks`); the generic strategies still do not draw ``sp > 1`` for verl
(cost), the sequence-parallel invariants force it.

The padded attention mask of verl < 0.8 (built from the response-only ``loss_mask``,
verl issue #6278) is deliberately *not* a known failure: a run against such a verl must
fail, on exactly the invariants of :data:`MASK_INVARIANTS` that apply to it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cases.structure import DISTILLATION_KEYS
from ..truth.oracle import LOG_PROB_MIN_CLAMP
from ..protocol.known import KnownFailure, When

from ..protocol.engine import CONTRACT_PRECISION, HELPERS, ConfigSwitch, EngineUnderTest, Precision, ReproSnippet
from ..protocol.microbatch import MicroBatchLayer, layer_from
from ..protocol.profile import VERL_CONVENTIONS, Convention
from ..protocol.vendor import assignments, source
from .microbatch_records import MICROBATCH_RECORDS
from .verl_mutants import VERL_EQUIVALENT_MUTANTS

__all__ = ["VerlEngine", "VerlEngineObject", "VerlCapabilities", "probe_verl", "KNOWN_BUGS", "MASK_INVARIANTS",
           "known_key", "verl_microbatch_layer", "verl_precision", "LOW_PRECISION_RECORDS", "fp16_records",
           "fp16_clamp_cast_records", "fused_padded_dense_slices", "FUSED_PADDED_INVARIANTS"]

#: The rule for "the mask failure" (docs/verl-conformance.md): an invariant belongs here iff its
#: check, in padded mode, reads the attention mask or compares an output the model computed under
#: that mask against a mask-independent reference (the per-sequence oracle or the packed run).
#: A wrong padded mask can make exactly these fail and nothing else.
MASK_INVARIANTS = frozenset({
    "INV-MASK-001",   # the mask rows themselves (n_i leading ones)
    "INV-MASK-003",   # the mask's shape and sum (total_nnz)
    "INV-VAL-001",    # padded log_probs vs the oracle
    "INV-VAL-002",    # padded entropy vs the oracle
    "INV-VAL-003",    # padded sum_pi_squared vs the oracle
    "INV-VAL-004",    # padded distillation keys vs the oracle
    "INV-VAL-005",    # padded value head vs the oracle
    "INV-KEYS-003",   # padded vs packed values
    "INV-TEMP-001",   # padded log_probs vs the oracle, per-sample temperatures
    "INV-TEMP-003",   # padded log_probs vs the oracle, T = 1
    "INV-SLICE-002",  # the response slice of padded log_probs vs the oracle
    "INV-TEMP-006",   # padded log_probs vs the oracle at temperatures at and below the 1e-8 clamp
    "INV-MB-015",     # padded log_probs/entropy after micro-batching vs the oracle
    "INV-SLICE-006",  # the protocol's response view of padded log_probs vs the oracle
})


def known_key(invariant: str, mode: str | None = None) -> str:
    """The key of a known-failure record: ``ID`` (every mode) or ``ID/mode`` (that mode only)."""
    return invariant if mode is None else f"{invariant}/{mode}"


def _seq_lens(case: Any) -> tuple[int, ...]:
    return tuple(p + r for p, r in zip(case.prompt_lens, case.response_lens))


#: Conditions on the drawn case (EngineCase or DenseCase) that verl's known failures need.
MROPE_EQUAL_OR_SINGLE = When("mRoPE positions with B = 1 or all sequence lengths equal",
                             lambda c: c.mrope and len(set(_seq_lens(c))) == 1)
SCALED_TEMPERATURE = When("a temperature other than 1 (the in-place division changes the logits)",
                          lambda c: not getattr(c, "use_fused_kernels", False)
                          and any(t != 1.0 for t in c.temperatures()))
UNEQUAL_RESPONSES = When("response lengths differ", lambda c: len(set(c.response_lens)) > 1)
EQUAL_RESPONSES_WIDER = When("all response lengths equal and the max_response_len flag wider than them",
                             lambda c: len(set(c.response_lens)) == 1 and c.response_width > c.response_lens[0])
TEACHER = When("teacher top-K tensors present (topk >= 1)", lambda c: bool(c.topk))
#: a value model with a v_head (trl's AutoModelForCausalLMWithValueHead: the engine reads output[2])
V_HEAD = When("a v_head value model (engine config v_head=True)",
              lambda c: getattr(c, "head", "lm") == "value" and dict(getattr(c, "engine_config", ())).get("v_head", False))
#: where a float32 difference of two large, nearly equal terms loses the digits of a small result
CANCELLATION = When("a temperature below 0.1 or a vocabulary above 32,768 (float32 cancellation)",
                    lambda c: min(c.temperatures()) < 0.1 or c.vocab > 32_768)

#: calculate_sum_pi_squared_from_logits (verl 0.9): excused within the float32 cancellation bound only
SUM_PI_SQUARED_CANCELLATION = KnownFailure(
    "INV-VAL-003", "calculate_sum_pi_squared_from_logits computes exp(logsumexp(2z) - 2 logsumexp(z)): "
    "the difference of two large float32 terms at low temperature or a large vocabulary; verl bug "
    "(precision)", when=CANCELLATION, certain=False, raises=AssertionError, bound=("float32_cancellation", 1.0),
    matches=r"^AssertionError: 'sum_pi_squared' of sequence \d+: at \(\d+,\) got .* \(\|diff\| .* > allowed")

#: verl's own top-K processor (compute_forward_kl_topk) counts the overlap as an integer
NO_FUSED_AUX = When("a fused kernel without the distillation terms (no fused_linear_aux, printed no_fused_aux)",
                    lambda c: not c.fused_aux)
DISTILLATION_ASKED = When("top-K distillation asked (verl's own processor runs)", lambda c: bool(c.distillation_keys))
OVERLAP_COUNT_INT64 = KnownFailure(
    "INV-DEV-001", "verl's own top-K processor returns overlap_count as int64 (overlap_mask.sum(dim=-1), a count; "
    "prepare_model_outputs nests it as it comes); contract difference (the contract's outputs are float32), the "
    "count's value is compared elsewhere", when=DISTILLATION_ASKED, raises=AssertionError,
    matches=r"^AssertionError: output 'overlap_count' has dtype torch\.int64, expected torch\.float32$")

#: low-precision (bf16/fp16) logits on the path where verl computes in the logits' own dtype (not fused kernels)
LOW_PRECISION = When("bf16/fp16 logits (verl scales them and takes log-softmax, entropy and sum_pi_squared in that "
                     "dtype, and returns them in it)",
                     lambda c: getattr(c, "logits_dtype", "float32") != "float32"
                     and (not getattr(c, "use_fused_kernels", False) or getattr(c, "head", "lm") == "value"))
#: the lower logits dtypes verl computes in, each its own cancellation mechanism (spec.truth.oracle.cancellation_bounds)
LOW_DTYPES = ("bfloat16", "float16")


def _logits_in(dtype: str) -> When:
    return When(f"{dtype} logits", lambda c: getattr(c, "logits_dtype", "float32") == dtype)


#: where verl's entropy is the unchunked entropy_from_logits in the logits' dtype (the padded path always; the packed
#: path without engine_config.entropy_from_logits_with_chunking, whose chunks are upcast to float32)
LOW_PRECISION_ENTROPY = LOW_PRECISION & When(
    "entropy not chunked (entropy_from_logits: logsumexp(z) - sum(softmax(z) * z), each rounded to that dtype)",
    lambda c: not (c.use_remove_padding and c.entropy_chunk_size))
#: where it is the packed chunked entropy_from_logits_with_chunking: chunks of the bf16/fp16-scaled logits upcast to
#: float32, logsumexp(z) - sum(softmax(z) * z) cancelling there
LOW_PRECISION_CHUNKED_ENTROPY = LOW_PRECISION & When(
    "the packed entropy chunked (entropy_from_logits_with_chunking: float32 chunks of the scaled logits)",
    lambda c: bool(c.use_remove_padding and c.entropy_chunk_size))

#: what verl computes in the logits' own dtype, as a consumer sees it (the FSDP engine; TorchTitan and Automodel carry
#: them too, spec.engines.verl_records): outputs in that dtype (INV-DEV-001), entropy_from_logits's cancellation in
#: it (INV-VAL-002, bounded), and the packed chunked float32 entropy against the unchunked one (INV-KEYS-003,
#: INV-CHUNK-001, within twice that bound)
LOW_PRECISION_RECORDS: tuple[KnownFailure, ...] = (
    KnownFailure(
        "INV-DEV-001", "returns log_probs, entropy, sum_pi_squared (and a value head's values) in the logits' "
        "dtype: bf16/fp16 outputs where the contract says float32 (each adapter's precision() declares which "
        "keys on which path); contract difference, the values are compared at that precision elsewhere",
        when=LOW_PRECISION, raises=AssertionError,
        matches=r"^AssertionError: output '(log_probs|entropy|sum_pi_squared|values)' has dtype "
                r"torch\.(bfloat16|float16), expected torch\.float32$"),
    *(KnownFailure(
        "INV-VAL-002", reason.format(dtype=dtype), when=path & _logits_in(dtype), certain=False,
        raises=AssertionError, bound=(f"{dtype}_cancellation", 1.0),
        matches=r"^AssertionError: 'entropy' of sequence \d+: at \(\d+,\) got .* \(\|diff\| .* > allowed")
      for path, reason in (
          (LOW_PRECISION_ENTROPY, "entropy_from_logits in {dtype}: logsumexp(z) - sum(softmax(z) * z), two terms of "
                                  "|z| rounded to that dtype whose difference is a small entropy (beyond the declared "
                                  "precision's rounding where the entropy's condition is small); verl bug (precision)"),
          (LOW_PRECISION_CHUNKED_ENTROPY, "entropy_from_logits_with_chunking on {dtype}-scaled logits: each chunk "
                                          "upcast to float32 and logsumexp(z) - sum(softmax(z) * z) taken there, a "
                                          "float32 cancellation of terms of |z| on top of the scaled logits' {dtype} "
                                          "rounding where the entropy is small (within that dtype's cancellation "
                                          "bound); verl bug (precision)"))
      for dtype in LOW_DTYPES),
    *(KnownFailure(
        inv, f"the packed chunked entropy (float32 chunks) against the unchunked entropy_from_logits in {dtype} "
        "(the padded path never chunks): logsumexp(z) - sum(softmax(z) * z) cancels beyond the declared "
        "precision's rounding where the entropy is small; verl bug (precision), the INV-VAL-002 record's cause "
        "(excused within twice that cancellation's bound: the difference of two runs)",
        when=LOW_PRECISION & _logits_in(dtype) & When(
            "entropy asked with a chunk size set", lambda c: c.calculate_entropy and bool(c.entropy_chunk_size)),
        certain=False, raises=AssertionError, bound=(f"{dtype}_cancellation", 2.0),
        matches=r"^AssertionError: (padded vs packed|entropy_chunk_size=\d+ vs none): 'entropy' of sequence \d+: "
                r"at \(\d+,\) got .* \(\|diff\| .* > allowed")
      for inv in ("INV-KEYS-003", "INV-CHUNK-001") for dtype in LOW_DTYPES),
)

#: verl's own top-K processor takes the student's log-probs in the logits' dtype and sums their mass there
STUDENT_MASS_LOW_PRECISION = KnownFailure(
    "INV-DEV-001", "verl's own top-K processor returns student_mass in the logits' dtype (the mass of log-probs "
    "log_softmax takes in it: bf16/fp16 where the contract says float32; VerlEngine.precision declares it); contract "
    "difference, the value is compared at that precision elsewhere", when=LOW_PRECISION & DISTILLATION_ASKED,
    raises=AssertionError,
    matches=r"^AssertionError: output 'student_mass' has dtype torch\.(bfloat16|float16), expected torch\.float32$")

FUSED = When("fused kernels", lambda case: bool(getattr(case, "use_fused_kernels", False)))
#: INV-FLAG-001 calls no_padding_2_padding on the outputs only where it drops max_response_len, given at its
#: default max(r_i)
FUSED_DEFAULT_MAX_RESPONSE = When(
    "fused kernels, max_response_len given at its default max(r_i)",
    lambda case: bool(getattr(case, "use_fused_kernels", False)) and getattr(case, "max_response_len", None)
    is not None and case.max_response_len == max(case.response_lens))
#: every invariant that reads a padded output value or its layout (a dense response slice fails each)
FUSED_PADDED_INVARIANTS = ("INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-CHUNK-001", "INV-LAYOUT-001",
                           "INV-LEAK-001", "INV-LEAK-002",
                           *sorted(MASK_INVARIANTS - {"INV-MB-015"}))  # micro-batch cases draw no fused kernels


def fused_padded_dense_slices(why: str, invariants: tuple[str, ...] = FUSED_PADDED_INVARIANTS,
                              extra: str = "") -> tuple[KnownFailure, ...]:
    """The padded fused branch that returns dense response slices ``output.log_probs[:, -L-1:-1]`` (L = the
    max_response_length flag) instead of nested full sequences (Automodel 0.9.1, the FSDP engine of 0.7.1):
    every padded invariant that reads the values or their layout fails on the layout."""
    reason = ("padded fused kernels return dense response slices output.log_probs[:, -L-1:-1] (L = the "
              "max_response_length flag, default 1024) instead of nested full sequences; " + why)
    matches = (r"dense tensor|dense \(|not a nested tensor|is not finite|values expected sparse|"
               r"response_view: shape \(\d+, \d+, \d+\)|response_view: 'log_probs' of shape" + extra)
    return tuple(KnownFailure(inv, reason, raises=(AssertionError, RuntimeError), matches=matches, when=FUSED,
                              modes=() if inv == "INV-KEYS-003" else ("padded",))
                 for inv in dict.fromkeys(invariants))


#: version -> the known-failure records of that release ("*": every release). Each names the cases it
#: applies to and the failure it expects; docs/verl-conformance.md has a minimal counterexample for each.
KNOWN_BUGS: dict[str, tuple[KnownFailure, ...]] = {
    "*": (
        KnownFailure(
            "INV-FUSED-003", "the padded fused-kernel path of FSDPEngineWithLMHead.prepare_model_outputs (use_remove_"
            "padding=False, use_fused_kernels) takes log_probs and entropy from the model and neither reads "
            "fused_linear_aux nor calls the logits processor: with top-K distillation the distillation keys are "
            "missing (the packed path reads them); verl gap, not a wrong value",
            modes=("padded",), raises=AssertionError,
            matches=r"padded outputs lack \['distillation_losses', 'student_mass', 'teacher_mass'\]"),
        KnownFailure(
            "INV-FUSED-003", "the packed fused-kernel path of FSDPEngineWithLMHead.prepare_model_outputs takes the "
            "distillation terms only from the model output's fused_linear_aux: a fused kernel that computes log-probs "
            "and entropy only (verl's own fused forward) leaves every distillation key missing, silently, although "
            "the logits are there for the processor; verl gap, not a wrong value",
            modes=("packed",), raises=AssertionError, when=NO_FUSED_AUX,
            matches=r"packed outputs lack \['distillation_losses', 'student_mass', 'teacher_mass'\]"),
        KnownFailure(
            "INV-MUT-003", "left_right_2_no_padding converts the TensorDict it is given in place and returns it "
            "(pops input_ids, writes nested input_ids/position_ids, loss_mask, max_seq_len, max_response_len, "
            "indices); contract difference by design, not a wrong value",
            raises=AssertionError,
            # exactly verl's key change: the dense keys before, the same plus verl's added keys after
            matches=r"input keys changed: \[[^\]]*\] -> \[(?=[^\]]*'indices')(?=.*'loss_mask')"
                    r"(?=.*'max_response_len')(?=.*'max_seq_len')[^\]]*\]$"),
        KnownFailure(
            "INV-DENSE-002", "left_right_2_no_padding builds mRoPE position_ids with torch.nested.as_nested_tensor, "
            "which makes the 4 axes ragged when all lengths are equal or B = 1 ((B, j, n) instead of (B, 4, j)); "
            "verl bug (verl PR #5689 / issue #7899)",
            when=MROPE_EQUAL_OR_SINGLE, raises=AssertionError,
            matches=r"mRoPE position_ids have shape \(\d+, j\d*, \d+\) ragged at dim 1, expected \(B, 4, j\)"),
        KnownFailure(
            "INV-FLAG-003", "reads every flag with get_non_tensor_data and tests it by truthiness, with no type "
            "check: use_remove_padding='False' (a str) runs packed, None runs padded, a float pad_token_id pads "
            "with it; contract difference (invariant 10), not a wrong value for well-typed flags",
            raises=AssertionError, matches=r"^AssertionError: flag \w+=.* was accepted (silently|by the engine)"),
        KnownFailure(
            "INV-SET-001", "the engine takes its settings as attributes and never checks them (verl validates "
            "its config dataclasses elsewhere, before an engine is built): an entropy chunk size of 0 or a bucket "
            "of -8 reaches prepare_model_inputs unchecked; contract difference, not a wrong value for valid settings",
            raises=AssertionError, matches=r"^AssertionError: engine settings \{.*\} was accepted (silently|by the engine)"),
        KnownFailure(
            "INV-VAL-002", "entropy_from_logits computes logsumexp(z) - sum(softmax(z) * z): two large, nearly equal "
            "float32 terms whose difference is a small entropy (low temperature, large vocabulary); verl bug "
            "(precision), impl had it too and now sums -p log p",
            when=CANCELLATION, certain=False, raises=AssertionError, bound=("float32_cancellation", 1.0),
            matches=r"^AssertionError: 'entropy' of sequence \d+: at \(\d+,\) got .* \(\|diff\| .* > allowed"),
        *LOW_PRECISION_RECORDS,
    ),
    "0.7.1": (
        KnownFailure(
            "INV-FLAG-004", "verl 0.7.1 refuses neither setting 0.9.1 refuses: it has no sum_pi_squared and ignores "
            "calculate_sum_pi_squared with fused kernels (0.9.1 raises NotImplementedError), and its "
            "prepare_model_outputs does not check pad_mode (0.9.1 asserts no_padding first); contract difference",
            raises=AssertionError,
            matches=r"^AssertionError: (use_fused_kernels with calculate_sum_pi_squared|prepare_model_outputs \(a "
                    r"valid run's model output and output_args\) with pad_mode=\w+) .*was accepted silently"),
        KnownFailure(
            "INV-VAL-005", "the value head's padded branch keeps the trailing 1: values are (B, j, 1), packed gives "
            "(B, j); verl bug, fixed in later verl", modes=("padded",), when=~V_HEAD, raises=AssertionError,
            matches=r"values'? of sequence \d+(:| has) shape \(\d+, 1\), expected \(\d+,\)"),
        KnownFailure(
            "INV-VAL-005", "a v_head value model's packed branch unsqueezes the values it read (output[2].squeeze(0)"
            ".unsqueeze(-1)) and never squeezes them again: values are (B, j, 1); verl bug, fixed in later verl",
            modes=("packed",), when=V_HEAD, raises=AssertionError,
            matches=r"values'? of sequence \d+(:| has) shape \(\d+, 1\), expected \(\d+,\)"),
        KnownFailure(
            "INV-FUSED-001", "fused kernels get no shift_labels: the model rolls its own (per-shard under sp > 1) "
            "ids; verl bug #6068, fixed in later verl", modes=("packed",), raises=AssertionError,
            matches=r"shift_labels\)? None, expected the rolled ids"),
        KnownFailure(
            "INV-SLICE-003", "no_padding_2_padding handles (total_nnz,) values only: with trailing dims F.pad pads "
            "the last (feature) axis, so rows of unequal responses cannot be stacked; fixed in later verl",
            when=UNEQUAL_RESPONSES, raises=RuntimeError, matches=r"stack expects each tensor to be equal size"),
        KnownFailure(
            "INV-SLICE-003", "no_padding_2_padding handles (total_nnz,) values only: with trailing dims and equal "
            "responses F.pad silently widens the feature axis instead of the response axis; fixed in later verl",
            when=EQUAL_RESPONSES_WIDER, raises=AssertionError,
            matches=r"no_padding_2_padding shape \(\d+, \d+, \d+\), expected \(\d+, \d+, 3\)"),
        # the mask rows themselves (INV-MASK-001/003) are never excused: the mask failure shows in full
        *fused_padded_dense_slices("verl bug, fixed in later verl (0.9.1's engine re-packs them by the full lengths)",
                                   tuple(i for i in FUSED_PADDED_INVARIANTS if i not in ("INV-MASK-001", "INV-MASK-003")),
                                   extra=r"|^AssertionError: $"),  # the response slice: no_padding_2_padding's bare assert
        *(KnownFailure(
            inv, "padded fused kernels return dense response slices (B, L) instead of nested full sequences, and "
            "no_padding_2_padding, handed them, fails its bare assert (its dense branch asserts the attention mask is "
            "not nested); verl bug, fixed in later verl", modes=("padded",), when=when, raises=AssertionError,
            matches=r"^AssertionError: $")
          for inv, when in (("INV-FLAG-001", FUSED_DEFAULT_MAX_RESPONSE), ("INV-FLAG-002", FUSED),
                            ("INV-SLICE-001", FUSED))),
        *(KnownFailure(
            inv, "fused kernels get no shift_labels on real sequence-parallel ranks either: each rank's model rolls "
            "its own shard's ids (verl bug #6068, the INV-FUSED-001 record's, fixed in later verl)", modes=("packed",),
            when=FUSED, raises=AssertionError, matches=r"shift_labels (has shape )?None")
          for inv in ("INV-RANK-002", "INV-RANK-006", "INV-RANK-008")),
        KnownFailure(
            "INV-DENSE-004", "left_right_2_no_padding predates top-K distillation: teacher_ids/teacher_logprobs "
            "stay dense (B, S, K)", when=TEACHER, raises=AssertionError,
            matches=r"teacher_ids has shape \(\d+, \d+, \d+\), expected nested"),
    ),
}

#: float16 logits with a temperature that rounds to 0 in float16 (verl casts the clamped temperature to the logits'
#: dtype: clamp(min=1e-8).to(float16) is 0 below 2**-25, and logits / 0 is inf or NaN)
FP16_ZERO_TEMPERATURE = When("float16 logits and a temperature below 3e-8 (T.clamp(min=1e-8).to(float16) is 0: "
                             "logits / 0)",
                             lambda c: getattr(c, "logits_dtype", "") == "float16"
                             and not getattr(c, "use_fused_kernels", False) and min(c.temperatures()) < 3e-8)
#: every invariant that reads an output value of such a case (against the oracle, another run or finiteness)
FP16_ZERO_TEMPERATURE_INVARIANTS = ("INV-VAL-001", "INV-VAL-002", "INV-VAL-003", "INV-VAL-004", "INV-TEMP-001",
                                    "INV-TEMP-002", "INV-TEMP-004", "INV-TEMP-005", "INV-TEMP-006", "INV-SLICE-002",
                                    "INV-SLICE-006", "INV-KEYS-003", "INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-SP-001",
                                    "INV-SP-002", "INV-CHUNK-001", "INV-LEAK-001", "INV-RANK-001", "INV-RANK-004",
                                    "INV-RANK-005", "INV-RANK-007")


#: float16 logits over a vocabulary wider than float16's range: the softmax's sum of up to V terms of at most 1
FP16_WIDE_VOCAB = When("float16 logits and a vocabulary above 65,504 ids (a log-softmax taken in float16 sums up to V "
                       "terms <= 1: the sum overflows to inf on CPU)",
                       lambda c: getattr(c, "logits_dtype", "") == "float16"
                       and not getattr(c, "use_fused_kernels", False) and c.vocab > 65_504)


def fp16_records(when: When, reason: str) -> tuple[KnownFailure, ...]:
    """One float16 overflow/NaN record per invariant of :data:`FP16_ZERO_TEMPERATURE_INVARIANTS`: on ``when``, a
    NaN/inf value or a non-finite output, possible not certain (it depends on the logits' values)."""
    return tuple(KnownFailure(inv, reason, when=when, certain=False, raises=AssertionError,
                              matches=r"got (nan|-?inf)\b|is not finite") for inv in FP16_ZERO_TEMPERATURE_INVARIANTS)


#: why FP16_WIDE_VOCAB fails (every verl engine that takes the log-softmax in the logits' dtype)
FP16_WIDE_VOCAB_REASON = (
    "takes log-softmax, entropy and sum_pi_squared in the logits' dtype: in float16 the softmax's sum over a vocabulary "
    "above 65,504 ids overflows (torch's CPU kernel accumulates in float16) and log-probs come out -inf; verl bug "
    "(precision: the contract computes in float32)")


def fp16_clamp_cast_records() -> tuple[KnownFailure, ...]:
    """The float16 records of an engine that scales by the clamped temperature cast to the logits' dtype."""
    return fp16_records(FP16_ZERO_TEMPERATURE, "casts the clamped temperature to the logits' dtype "
                        "(temperature.clamp(min=1e-8).to(logits.dtype): the FSDP engine's _scale_logits_by_temperature, "
                        "Automodel's prepare_model_outputs): in float16 a "
                        "temperature at the 1e-8 clamp is 0 and the scaled logits inf/NaN; verl bug (the contract "
                        "clamps at 1e-8 in float32)") + fp16_records(FP16_WIDE_VOCAB, FP16_WIDE_VOCAB_REASON)


def verl_precision(key: str, case: Any) -> Precision:
    """verl scales the logits in their own dtype (``_scale_logits_by_temperature``: ``logits / T.to(dtype)``)
    and computes every output from them there: log_probs (``logprobs_from_logits``), entropy
    (``entropy_from_logits``) and sum_pi_squared come back in the logits' dtype, except the packed chunked
    entropy (``entropy_from_logits_with_chunking`` upcasts each chunk: float32); the distillation terms are the
    suite's processor's (float32) from verl's scaled logits; fused kernels return the model's float32 values;
    a value head's values are its logits, squeezed. The FSDP engine's rule, and Automodel's (its
    ``prepare_model_outputs`` scales by ``temperature.clamp(min=1e-8).to(logits.dtype)`` the same way)."""
    low = getattr(case, "logits_dtype", "float32")
    if low == "float32":
        return CONTRACT_PRECISION
    if getattr(case, "use_fused_kernels", False) and key in ("log_probs", "entropy"):
        return CONTRACT_PRECISION
    if key == "entropy" and case.use_remove_padding and case.entropy_chunk_size:
        return Precision("float32", low)
    if key in DISTILLATION_KEYS:
        return Precision("float32", low)
    return Precision(low, low)


@dataclass(frozen=True)
class VerlCapabilities:
    version: str
    processor: bool  # prepare_model_outputs takes logits_processor_func (top-K distillation)
    bucket: bool  # static pad_to_length bucket
    sum_pi_squared: bool  # calculate_sum_pi_squared is read by prepare_model_outputs
    cu_seqlens: bool  # the engine reads pass_packed_cu_seqlens (packed cu_seqlens in the model inputs)
    helpers: tuple[str, ...]  # padding helpers verl ships
    attention_utils_error: str | None  # why verl.utils.attention_utils cannot run here (0.7.1 without flash-attn)
    #: why verl's own top-K distillation processor (verl.trainer.distillation: distillation_ppo_loss and its
    #: fsdp compute_forward_kl_topk) cannot be the companion here (None: it can; verl 0.7.1 ships no such module)
    own_processor_error: str | None = "not probed"
    #: prepare_model_outputs scales the logits out of place (_scale_logits_by_temperature, after verl 0.7.1,
    #: which divides them in place): the LOGITS_UNTOUCHED convention holds
    logits_untouched: bool = True


def _attention_utils_error() -> str | None:
    try:
        from verl.utils.attention_utils import _get_attention_functions

        _get_attention_functions()
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - an unexpected layout: let the helper run and show what happens
        return None
    return None


def probe_verl() -> VerlCapabilities:
    """What the installed verl offers (ImportError when verl is not installed)."""
    import verl
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.utils import padding

    lm = transformer_impl.FSDPEngineWithLMHead
    try:
        source = inspect.getsource(lm.prepare_model_outputs)
    except (OSError, TypeError):  # no source: assume the flag is read, so a missing key is reported
        source = "calculate_sum_pi_squared"
    return VerlCapabilities(
        version=str(getattr(verl, "__version__", "?")),
        processor="logits_processor_func" in inspect.signature(lm.prepare_model_outputs).parameters,
        bucket=hasattr(transformer_impl.FSDPEngine, "_get_packed_pad_size"),
        sum_pi_squared="calculate_sum_pi_squared" in source,
        cu_seqlens="pass_packed_cu_seqlens" in _module_source(transformer_impl),
        helpers=tuple(name for name in HELPERS if callable(getattr(padding, name, None))),
        attention_utils_error=_attention_utils_error(),
        own_processor_error=_own_processor_error(),
        logits_untouched=hasattr(transformer_impl, "_scale_logits_by_temperature"),
    )


#: where verl keeps the top-K distillation processor a real run hands prepare_model_outputs
#: (verl.workers.engine_workers: partial(distillation_ppo_loss, config=actor_config, distillation_config=...))
OWN_PROCESSOR_MODULES = ("verl.trainer.distillation.losses", "verl.trainer.distillation.fsdp.losses")


def _own_processor_error() -> str | None:
    """Why the installed verl's own top-K processor cannot run (its modules and names probed), or None."""
    try:
        losses = importlib.import_module(OWN_PROCESSOR_MODULES[0])
        fsdp = importlib.import_module(OWN_PROCESSOR_MODULES[1])
        from verl.workers.config import DistillationConfig, DistillationLossConfig  # noqa: F401
    except ImportError as exc:
        return f"no verl.trainer.distillation ({type(exc).__name__}: {exc})"
    missing = [name for module, name in ((losses, "distillation_ppo_loss"), (fsdp, "compute_forward_kl_topk"))
               if not callable(getattr(module, name, None))]
    return f"verl.trainer.distillation lacks {missing}" if missing else None


#: where the installed verl keeps its micro-batch layer (0.9.1; a module an older verl lacks is skipped)
MICROBATCH_MODULES = ("verl.workers.engine.utils", "verl.utils.seqlen_balancing", "verl.utils.tensordict_utils")


def verl_microbatch_layer() -> MicroBatchLayer | None:
    """The installed verl's own micro-batch functions, probed by import and name (never by version): every verl
    engine calls these same functions (``prepare_micro_batches``, ``postprocess_batch_func``)."""
    sources = []
    for name in MICROBATCH_MODULES:
        try:
            sources.append(importlib.import_module(name))
        except ImportError:
            continue
    if not sources:
        return None
    layer = layer_from("verl", sources)
    if not layer.functions:
        return None
    balancing = next((m for m in sources if m.__name__ == "verl.utils.seqlen_balancing"), None)
    cutters = {name: _cpu_collectives(layer.functions[name], balancing)
               for name in ("prepare_micro_batches", "rearrange_micro_batches") if name in layer.functions}
    return layer.with_functions("verl", **cutters) if balancing is not None else layer


def _cpu_collectives(fn: Callable, balancing: Any) -> Callable:
    """verl's ``rearrange_micro_batches`` puts the tensors of its data-parallel ``all_reduce`` on
    ``get_device_name()``, which on a machine without an accelerator still answers ``"cuda"`` (verl's platform
    fallback is 'nvidia'). On such a machine the call runs with that module's ``get_device_name`` answering
    ``"cpu"``, the device of the gloo group the suite's real ranks use; nothing else changes, and with an
    accelerator the function is verl's own, untouched."""
    if torch.cuda.is_available() or not callable(getattr(balancing, "get_device_name", None)):
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = balancing.get_device_name
        balancing.get_device_name = lambda: "cpu"
        try:
            return fn(*args, **kwargs)
        finally:
            balancing.get_device_name = saved

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def _module_source(module: Any) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


class VerlEngineObject:
    """One verl engine object behind the suite's calling convention.

    ``prepare_model_outputs(output, output_args, micro_batch, logits_processor_func=None)``
    passes the processor where verl takes one; a verl without the parameter is called with
    three arguments, exactly as its own ``forward_step`` calls it (it then ignores
    ``distillation_use_topk``: the suite reports the missing keys, it does not hide them).
    """

    def __init__(self, engine: Any, caps: VerlCapabilities, ulysses: Any = None):
        self.verl_engine = engine
        self.caps = caps
        self.ulysses = ulysses  # verl.utils.ulysses

    @contextmanager
    def _ulysses_group(self):
        """verl's Ulysses group for the call, as verl's engine mode contexts set it (None when sp = 1)."""
        ulysses = self.ulysses
        if ulysses is None:
            yield
            return
        previous = ulysses.get_ulysses_sequence_parallel_group()
        ulysses.set_ulysses_sequence_parallel_group(getattr(self.verl_engine, "ulysses_parallel_group", None))
        try:
            yield
        finally:
            ulysses.set_ulysses_sequence_parallel_group(previous)

    def prepare_model_inputs(self, micro_batch):
        self._vision_config_for(micro_batch)
        with self._ulysses_group():
            return self.verl_engine.prepare_model_inputs(micro_batch)

    def _vision_config_for(self, micro_batch) -> None:
        """mRoPE position ids come from vision-language models, whose config has a ``vision_config``: verl's
        Ulysses path then pads ids and positions without slicing them (the model slices after the embedding)
        and slices only the labels and temperature. The adapter presents such a config for mRoPE batches
        (verl reads it only when sp > 1) and a text-only one otherwise."""
        config = self.verl_engine.module.config
        if micro_batch["position_ids"].dim() == 3:
            config.vision_config = SimpleNamespace()
        elif hasattr(config, "vision_config"):
            del config.vision_config

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        if hasattr(self.verl_engine.module, "v_head"):
            # a v_head value model's output, as trl's AutoModelForCausalLMWithValueHead returns it: (lm_logits, loss,
            # value), the value head's per-token values (the stand-in's one-column logits) squeezed
            output = (None, None, output.logits.squeeze(-1))
        with self._ulysses_group():
            if self.caps.processor:
                return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch,
                                                              logits_processor_func)
            return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch)

    def __repr__(self) -> str:
        return f"<verl {self.caps.version} {type(self.verl_engine).__name__}>"


@functools.lru_cache(maxsize=None)
def _reads_attention_mask_before_branching(fn: Callable) -> bool:
    """Whether ``no_padding_2_padding`` reads ``data["attention_mask"]`` even for nested input (read from its source
    once per function: :meth:`VerlEngine.helper` asks on every call, and ``inspect.getsource`` re-reads the file)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return 'data["attention_mask"]' in source.split("if prompt_ids.is_nested", 1)[0]


def _with_dense_attention_mask(fn: Callable) -> Callable:
    """Calls verl 0.7.1's ``no_padding_2_padding``, which reads ``data["attention_mask"]`` before
    it branches although its nested branch never uses the value (lengths come from the nested
    ``prompts``/``responses``). In verl's own flow the key is always there: the dense mask that
    ``left_right_2_no_padding`` keeps. The suite's micro-batches are nested from the start, so
    the dense full-length mask is added to a shallow copy when the key is missing. The caller's
    TensorDict is not touched and no value verl computes is changed
    (tests/test_verl_conformance.py checks that the mask's value does not matter)."""

    def no_padding_2_padding(tensor, data):
        if "attention_mask" not in data.keys() and data["prompts"].is_nested:
            lens = (data["input_ids"].offsets().diff() if "input_ids" in data.keys()
                    else data["prompts"].offsets().diff() + data["responses"].offsets().diff())
            cols = torch.arange(int(lens.max()), device=lens.device)
            data = data.copy()
            data.set("attention_mask", (cols.unsqueeze(0) < lens.unsqueeze(1)).to(torch.int64))
        return fn(tensor, data)

    no_padding_2_padding.__wrapped__ = fn  # type: ignore[attr-defined]
    no_padding_2_padding.__doc__ = _with_dense_attention_mask.__doc__
    return no_padding_2_padding


_FSDP = "verl.workers.engine.fsdp.transformer_impl"
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
_SB, _TU, _EU = "verl.utils.seqlen_balancing", "verl.utils.tensordict_utils", "verl.workers.engine.utils"
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


class VerlEngine(EngineUnderTest):
    """The installed verl's FSDP engines (CI runs 0.9.1; 0.7.1 is the pre-#6345 reference)."""

    name = "verl"
    #: the preparation code spec verify measures (spec.run.engine_coverage): the FSDP engine's prepare_model_inputs /
    #: prepare_model_outputs and what they call of verl, the padding helpers, the micro-batch layer and its helpers
    profile = replace(EngineUnderTest.profile, surface=VERL_SURFACE, unreachable=VERL_UNREACHABLE,
                      off_path=VERL_OFF_PATH, conventions=VERL_CONVENTIONS, refuses=VERL_REFUSES,
                      equivalent_mutants=VERL_EQUIVALENT_MUTANTS)
    #: sp > 1 needs a real process group: spec.execute.harness sends those cases to real ranks
    sp_on_real_ranks = True

    def __init__(self) -> None:
        with warnings.catch_warnings():  # verl's engine registry warns about every optional backend it lacks
            warnings.simplefilter("ignore", UserWarning)
            try:
                self.caps = probe_verl()
            except ImportError as exc:
                raise ImportError(f"--engine verl needs verl installed (pip install verl): {exc}") from exc
        from verl.utils import torch_functional as verl_F
        from verl.utils import ulysses
        from verl.workers.engine.fsdp import transformer_impl
        from verl.workers.utils import padding

        self._verl_F = verl_F
        self._ulysses = ulysses
        self._classes = {"lm": transformer_impl.FSDPEngineWithLMHead,
                         "value": transformer_impl.FSDPEngineWithValueHead}
        self._padding = padding
        if not self.caps.logits_untouched:  # verl 0.7.1 divides the logits in place: not its convention yet
            self.profile = replace(self.profile, conventions=self.profile.conventions - {Convention.LOGITS_UNTOUCHED})
        self.known_failures = self._known_failures()

    # -- what this verl lacks, supports, and is known to get wrong ---------------------------
    def _known_failures(self) -> tuple[KnownFailure, ...]:
        """The records of this release, plus the feature gaps the probes find (each on the cases that
        ask for the missing feature only)."""
        caps = self.caps
        records = [*KNOWN_BUGS["*"], *KNOWN_BUGS.get(caps.version, ()), *MICROBATCH_RECORDS.get("*", ()),
                   *MICROBATCH_RECORDS.get(caps.version, ()), *fp16_clamp_cast_records()]
        missing = [flag for flag, has in (("calculate_sum_pi_squared", caps.sum_pi_squared),
                                          ("distillation_use_topk", caps.processor)) if not has]
        if missing:
            keys = (["sum_pi_squared"] if not caps.sum_pi_squared else []) + \
                   (list(DISTILLATION_KEYS) if not caps.processor else [])
            asks = When(f"the case sets {' or '.join(missing)}", lambda c: (
                (c.calculate_sum_pi_squared and not caps.sum_pi_squared)
                or (bool(c.distillation_keys) and not caps.processor)))
            only = "|".join(f"'{k}'" for k in keys)
            records.append(KnownFailure(
                "INV-KEYS-001", f"ignores {' and '.join(missing)} (no such output in this verl): the keys the flags "
                "ask for are missing in both modes", when=asks, raises=AssertionError,
                matches=rf"\(missing \[(?:(?:{only})(?:, )?)+\]\)$"))
        if caps.own_processor_error is None:
            records.extend((OVERLAP_COUNT_INT64, STUDENT_MASS_LOW_PRECISION))
        if caps.sum_pi_squared:
            records.append(SUM_PI_SQUARED_CANCELLATION)
            records.extend(KnownFailure(
                "INV-VAL-003", f"calculate_sum_pi_squared_from_logits in {dtype}: exp(logsumexp(2z) - 2 logsumexp(z)) "
                "with both logsumexps rounded to that dtype (an error of u * |logsumexp| in the exponent, beyond the "
                "declared precision's rounding); verl bug (precision)", when=LOW_PRECISION & _logits_in(dtype),
                certain=False, raises=AssertionError, bound=(f"{dtype}_cancellation", 1.0),
                matches=r"^AssertionError: 'sum_pi_squared' of sequence \d+: at \(\d+,\) got .* \(\|diff\| .* > allowed")
                for dtype in LOW_DTYPES)
        if not caps.sum_pi_squared:
            records.append(KnownFailure(
                "INV-VAL-003", "has no sum_pi_squared output: calculate_sum_pi_squared is ignored",
                raises=(KeyError, AssertionError), matches=r"sum_pi_squared"))
        return tuple(replace(r, reason=f"verl {caps.version}: {r.reason}") for r in records)

    def _helper_unusable(self, name: str) -> str | None:
        """Why verl's helper ``name`` cannot run here, or None."""
        if name not in self.caps.helpers:
            return f"verl {self.caps.version} ships no verl.workers.utils.padding.{name}"
        if name == "left_right_2_no_padding" and self.caps.attention_utils_error:
            return (f"verl {self.caps.version}'s left_right_2_no_padding calls verl.utils.attention_utils.unpad_input,"
                    f" which needs flash-attn (CUDA only) in this verl: {self.caps.attention_utils_error}")
        return None

    def lacks(self, feature: str) -> str | None:  # type: ignore[override]
        caps = self.caps
        if feature == "chunking" and getattr(self._verl_F, "entropy_from_logits_with_chunking", None) is None:
            return f"verl {caps.version} has no entropy_from_logits_with_chunking"
        if feature == "cu_seqlens" and not caps.cu_seqlens:
            return f"verl {caps.version} never passes cu_seqlens to the model (no pass_packed_cu_seqlens)"
        if feature == "bucket" and not caps.bucket:
            return f"verl {caps.version} has no static pad_to_length bucket"
        if feature == "distillation" and not caps.processor:
            return f"verl {caps.version}: prepare_model_outputs takes no logits_processor_func (no top-K distillation)"
        if feature in HELPERS:
            return self._helper_unusable(feature)
        return super().lacks(feature)  # type: ignore[misc]

    def strategy_limits(self) -> dict[str, Any]:  # type: ignore[override]
        """What a release does not offer, as probed; never what it gets wrong (bf16/fp16 logits and 0.7.1's fused
        kernels, once limited here, are drawn, their differences records of KNOWN_BUGS)."""
        caps = self.caps
        return {"allow_sp": False, "allow_bucket": caps.bucket, "allow_distillation": caps.processor,
                "allow_cu_seqlens": caps.cu_seqlens}

    def config_space(self) -> tuple[ConfigSwitch, ...]:  # type: ignore[override]
        """Every switch the FSDP engine's ``prepare_model_inputs``/``prepare_model_outputs`` read (installed code:
        ``verl/workers/engine/fsdp/transformer_impl.py`` and ``verl/utils/torch_functional.py``)."""
        return (
            ConfigSwitch("entropy_checkpointing", (False, True),
                         "engine_config.entropy_checkpointing: the entropy under torch.utils.checkpoint (both modes; "
                         "with chunking on, the chunked function at its default chunk of 2048)"),
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

    def precision(self, key: str, case: Any) -> Precision:  # type: ignore[override]
        """:func:`verl_precision`: outputs in the logits' dtype except the packed chunked entropy, the distillation
        terms and fused kernels' values (float32); with verl's own top-K processor (:meth:`logits_processor`)
        student_mass comes back in the logits' dtype (the mass of log-probs taken in it), the KL terms float32 from
        log-probs in it, teacher_mass float32 (the teacher's alone)."""
        low = getattr(case, "logits_dtype", "float32")
        if key in DISTILLATION_KEYS and low != "float32" and self.caps.own_processor_error is None:
            if key == "teacher_mass":
                return CONTRACT_PRECISION
            return Precision(low, low) if key == "student_mass" else Precision("float32", low)
        return verl_precision(key, case)

    # -- companions: verl's own top-K distillation processor --------------------------------------
    def logits_processor(self, case: Any, sp_size: int = 1, sp_rank: int = 0) -> Callable | None:  # type: ignore[override]
        """What a real verl 0.9 run hands ``prepare_model_outputs`` (``verl.workers.engine_workers``):
        ``partial(distillation_ppo_loss, config=<actor config, strategy fsdp>, distillation_config=...)``, its
        ``distillation_loss`` the top-K forward KL with the case's drawn switches (:data:`PROCESSOR_SWITCHES`).
        verl slices the teacher tensors itself under Ulysses SP, reading verl's module-level group, which
        :class:`VerlEngineObject` sets around the call on real ranks (verl never runs SP on the suite's threads:
        :meth:`make` refuses an SP engine without a process group). ``enabled=False``: the processor path reads
        ``distillation_loss`` only (``enabled`` needs teacher models and a resource pool). None where this verl has
        no such processor (the suite's stand-in)."""
        if self.caps.own_processor_error is not None:
            return None
        from functools import partial

        from verl.trainer.distillation.losses import distillation_ppo_loss

        drawn = dict(getattr(case, "engine_config", ()) or ())
        switches = (bool(drawn.get("use_chunked_topk", False)), int(drawn.get("chunked_topk_chunk_size", 4096)),
                    drawn.get(LOG_PROB_MIN_CLAMP))
        return partial(distillation_ppo_loss, config=self._actor_config(),
                       distillation_config=self._distillation_config(int(case.topk), *switches))

    def processor_keys(self, case: Any) -> tuple[str, ...] | None:  # type: ignore[override]
        """verl's processor returns all five keys (compute_forward_kl_topk), whatever the case asks."""
        return DISTILLATION_KEYS if self.caps.own_processor_error is None else None

    def companions(self) -> dict[str, str]:  # type: ignore[override]
        why = self.caps.own_processor_error
        return {"logits_processor": "own: verl.trainer.distillation.losses.distillation_ppo_loss (fsdp "
                                    "compute_forward_kl_topk), on one rank and on real ranks (verl's Ulysses group); never on the "
                                    "suite's SP threads: verl's SP runs on real ranks only (one process-global group)"
                if why is None else f"stand-in: verl {self.caps.version} ships no top-K processor of its own ({why})"}

    def _actor_config(self) -> Any:
        if getattr(self, "_actor", None) is None:
            from verl.workers.config import FSDPActorConfig

            self._actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
        return self._actor

    def _distillation_config(self, topk: int, chunked: bool, chunk_size: int, clamp: Any) -> Any:
        cache = self.__dict__.setdefault("_distillation_configs", {})
        key = (topk, chunked, chunk_size, clamp)
        if key not in cache:
            from verl.workers.config import DistillationConfig, DistillationLossConfig

            loss = DistillationLossConfig(loss_mode="forward_kl_topk", topk=topk, use_policy_gradient=False,
                                          log_prob_min_clamp=clamp, use_chunked_topk=chunked,
                                          chunked_topk_chunk_size=chunk_size)
            cache[key] = DistillationConfig(enabled=False, distillation_loss=loss)
        return cache[key]

    # -- engine objects and helpers -----------------------------------------------------------
    def make(self, head: str = "lm", **settings: Any) -> VerlEngineObject:
        sp_size = int(settings.pop("sp_size", 1) or 1)
        sp_rank = settings.pop("sp_rank", 0)
        group = getattr(settings.pop("all_gather", None), "group", None)
        bucket = settings.pop("pad_to_length", None)
        cu_seqlens = bool(settings.pop("pass_cu_seqlens", False))
        chunk = settings.pop("entropy_chunk_size", None)
        checkpointing = bool(settings.pop("entropy_checkpointing", False))
        v_head = bool(settings.pop("v_head", False))
        for switch in PROCESSOR_SWITCHES:  # the processor's (logits_processor reads them off the case), not the engine's
            settings.pop(switch, None)
        for unseen in ("use_torch_compile", "flash_attn_cross_entropy", "tensor_parallel_logits"):
            if settings.pop(unseen, False):
                raise NotImplementedError(f"verl adapter: {unseen}=True is not run by the suite")
        if settings:
            raise TypeError(f"unknown engine settings for verl: {sorted(settings)}")
        if sp_size > 1:
            _check_sp_group(group, sp_size, sp_rank)
        if bucket and not self.caps.bucket:
            raise NotImplementedError(self.lacks("bucket"))
        eng = object.__new__(self._classes[head])
        # what FSDPEngine.__init__ derives from ulysses_sequence_parallel_size (the group: its device mesh's "sp")
        eng.use_ulysses_sp = sp_size > 1
        eng.ulysses_sequence_parallel_size = sp_size
        eng.ulysses_parallel_group = group if sp_size > 1 else None
        chunked = getattr(self._verl_F, "entropy_from_logits_with_chunking", None)
        if chunk and chunked is None:
            raise NotImplementedError(self.lacks("chunking"))
        # verl's entropy chunking (engine_config.entropy_from_logits_with_chunking), packed path
        eng.engine_config = SimpleNamespace(entropy_checkpointing=checkpointing,
                                            entropy_from_logits_with_chunking=bool(chunk),
                                            entropy_from_logits_chunk_size=int(chunk or 2048), use_torch_compile=False)
        eng.compute_entropy_from_logits = chunked if chunk else self._verl_F.entropy_from_logits
        # read only for sp > 1 (vision_config: see VerlEngineObject._vision_config_for) and by the value head
        # (v_head absent: an HF token classifier)
        eng.module = SimpleNamespace(config=SimpleNamespace())
        if v_head and head == "value":  # trl's AutoModelForCausalLMWithValueHead: VerlEngineObject hands output[2]
            eng.module.v_head = SimpleNamespace()
        if cu_seqlens and not self.caps.cu_seqlens:
            raise NotImplementedError(self.lacks("cu_seqlens"))
        eng.pass_packed_cu_seqlens = cu_seqlens
        if self.caps.bucket:
            eng.pad_to_length = bool(bucket)
            eng.pad_to_length_bucket = int(bucket) if bucket else 1
        return VerlEngineObject(eng, self.caps, self._ulysses)

    def microbatch_layer(self) -> MicroBatchLayer | None:
        if not hasattr(self, "_microbatch"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._microbatch = verl_microbatch_layer()
        return self._microbatch

    def helper(self, name: str) -> Callable | None:
        if name not in HELPERS or self._helper_unusable(name):
            return None
        fn = getattr(self._padding, name)
        if name == "no_padding_2_padding" and _reads_attention_mask_before_branching(fn):
            return _with_dense_attention_mask(fn)
        return fn

    def repro_snippet(self, settings: Any) -> ReproSnippet | None:
        """The attribute setup of :meth:`make`, written out against verl's own classes (sequence parallelism
        needs a process group: a snippet only for a reproducer that starts its own ranks, ``real_ranks`` in the
        settings, whose all-gather carries the group). Where this verl ships its own top-K processor (0.9:
        :meth:`logits_processor`), the snippet builds it the same way (:mod:`.verl_repro_processor`) and the file
        hands it the engine; verl 0.7.1 ships none, so its file hands the stand-in it writes out, as the suite does.
        A subclass (VeOmni) keeps the default."""
        if type(self) is not VerlEngine:
            return super().repro_snippet(settings)
        if int(settings.get("sp_size", 1) or 1) > 1 and not settings.get("real_ranks"):
            return None  # verl's Ulysses path needs a process group: only a reproducer that starts real ranks has one
        # verl's own top-K processor where this verl ships it (logits_processor); else the file's stand-in
        own = self.caps.processor and self.caps.own_processor_error is None
        code = "\n".join([
            assignments({"TAKES_PROCESSOR": bool(self.caps.processor), "HAS_BUCKET": bool(self.caps.bucket)}),
            source("spec.engines.verl_repro"), *([source("spec.engines.verl_repro_processor")] if own else [])])
        return ReproSnippet(code, requires=f"verl=={self.caps.version}")

    def __repr__(self) -> str:
        return f"<engine verl {self.caps.version}>"


#: the switches of :meth:`VerlEngine.config_space` that configure verl's own top-K processor (DistillationLossConfig)
PROCESSOR_SWITCHES = ("use_chunked_topk", "chunked_topk_chunk_size", LOG_PROB_MIN_CLAMP)


def _check_sp_group(group: Any, sp_size: int, sp_rank: Any) -> None:
    """verl's Ulysses path reads world size and rank off a real process group: it must match the settings."""
    if group is None:
        raise NotImplementedError(
            "verl's Ulysses sequence parallelism needs a torch.distributed process group: pass an all_gather "
            "with a .group (impl.sequence_parallel.TorchDistributedAllGather) on real ranks (spec.execute.ranks)")
    if dist.get_world_size(group) != sp_size or dist.get_rank(group) != sp_rank:
        raise ValueError(f"sp_size={sp_size}, sp_rank={sp_rank} do not match the process group "
                         f"(world {dist.get_world_size(group)}, rank {dist.get_rank(group)})")

