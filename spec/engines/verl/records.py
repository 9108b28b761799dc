"""verl's known failures as precise records: those of each verl release (:data:`KNOWN_BUGS`, keyed by version,
``"*"`` for every version; :func:`known_failures` adds the feature gaps a probe finds), the conditions on the drawn
case they need, the precision rule verl's engines compute by (:func:`verl_precision`), and the records verl's native
engines (TorchTitan, Automodel) share with one another or with the FSDP engine: the same bug in the same shared code,
so one record each, in one place.

What is known to be *wrong* in a verl release is a fact about that release: a new release gets no excuse it has not
earned, and a fixed bug shows up as "unexpectedly passed". Each record has a minimal counterexample in
``spec/engines/verl/README.md`` (each engine's spec/engines/<engine>/README.md for the ones it carries).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...cases.structure import DISTILLATION_KEYS
from ...protocol.engine import CONTRACT_PRECISION, Precision
from ...protocol.known import ALWAYS, KnownFailure, When
from ...protocol.profile import drawn_config
from ..kit.records import CANCELLATION, SAMPLE_MISMATCH, VALUE_MISMATCH
from .microbatch_records import MICROBATCH_RECORDS

__all__ = ["KNOWN_BUGS", "MASK_INVARIANTS", "known_key", "known_failures", "verl_precision", "LOW_PRECISION_RECORDS",
           "fp16_records", "fp16_clamp_cast_records", "fused_padded_dense_slices", "FUSED_PADDED_INVARIANTS",
           "flag_types", "entropy_cancellation", "loss_mask_attention", "PER_SAMPLE_ON_VOCAB", "MASK_VISIBLE"]


#: The rule for "the mask failure" (spec/engines/verl/README.md): an invariant belongs here iff its
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
    "INV-MM-002",     # padded log_probs of a vision-language batch vs the oracle
    "INV-MM-004",     # padded log_probs of an audio batch vs the oracle
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
              lambda c: getattr(c, "head", "lm") == "value" and drawn_config(c).get("v_head", False))


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
#: them too, spec.engines.verl.records): outputs in that dtype (INV-DEV-001), entropy_from_logits's cancellation in
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
FUSED_PADDED_INVARIANTS = ("INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-CHUNK-001", "INV-EDGE-001",
                           "INV-LAYOUT-001", "INV-LEAK-001", "INV-LEAK-002",
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


#: verl's engines (FSDP, VeOmni, Automodel, TorchTitan, Megatron) take the entropy chunk size and the bucket unchecked
SETTINGS_UNCHECKED = KnownFailure(
    "INV-SET-001", "the engine takes its settings as attributes and never checks them, and neither do verl's "
    "engine config dataclasses (0.9.1: the __post_init__ of FSDPEngineConfig, McoreEngineConfig, VeOmni's, "
    "Automodel's and TorchTitan's check neither entropy_from_logits_chunk_size nor pad_to_length_bucket): an entropy "
    "chunk size of 0 or -1, or a bucket of -8, reaches the preparation unchecked; verl bug (validation), not a wrong "
    "value for valid settings", raises=AssertionError,
    matches=r"^AssertionError: engine settings \{.*\} was accepted (silently|by the engine)")


#: version -> the known-failure records of that release ("*": every release). Each names the cases it
#: applies to and the failure it expects; spec/engines/verl/README.md has a minimal counterexample for each.
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
        SETTINGS_UNCHECKED,
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
    NaN/inf value or a non-finite output, possible not certain (it depends on the logits' values). INV-VAL-004 also
    on an exact 0 where the oracle's value is not: the top-K distillation outputs of NaN log-probs (the teacher's
    top-K ids found in none of the student's: an overlap count, mass or token advantage of 0; seen on VeOmni,
    ``overlap_token_advantage`` 0 for -7.1e7 at T = 1e-8)."""
    return tuple(KnownFailure(inv, reason, when=when, certain=False, raises=AssertionError,
                              matches=r"got (nan|-?inf)\b|is not finite" + (r"|got 0, expected" if inv == "INV-VAL-004"
                                                                             else ""))
                 for inv in FP16_ZERO_TEMPERATURE_INVARIANTS)


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


def known_failures(caps: Any) -> tuple[KnownFailure, ...]:
    """The records of the release ``caps`` describes (a :class:`~spec.engines.verl.adapter.VerlCapabilities`), plus the
    feature gaps its probes found (each on the cases that ask for the missing feature only)."""
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


def _shared(invariant: str) -> KnownFailure:
    return next(r for r in KNOWN_BUGS["*"] if r.invariant == invariant)


def flag_types() -> KnownFailure:
    """Flags read with ``tu.get_non_tensor_data`` and tested by truthiness, as the FSDP engine does."""
    return _shared("INV-FLAG-003")


def entropy_cancellation(modes: tuple[str, ...] = ()) -> KnownFailure:
    """``verl_F.entropy_from_logits``: logsumexp(z) - sum(p z) cancels in float32 (low T, large vocabularies)."""
    record = _shared("INV-VAL-002")
    return KnownFailure(record.invariant, record.reason, raises=record.raises, matches=record.matches,
                        when=CANCELLATION, modes=modes, certain=False, bound=record.bound)


def loss_mask_attention(invariants: frozenset[str] | set[str] = MASK_INVARIANTS, *, reason: str) -> tuple[KnownFailure, ...]:
    """The padded attention mask built from the response-only ``loss_mask`` (verl #6278): the mask rows,
    and every padded output compared against a mask-independent reference (the rule of
    :data:`MASK_INVARIANTS`)."""
    patterns = {"INV-MASK-001": r"attention_mask row \d+ is \[[01, ]*\], expected \[[01, ]*\]",
                "INV-MASK-003": r"attention_mask sums to \d+, total_nnz is \d+"}
    return tuple(KnownFailure(inv, reason + (" (seen end to end through the micro-batch layer)" if inv in _END_TO_END
                                             else ""),
                              raises=AssertionError, when=ALWAYS if inv in patterns else MASK_VISIBLE,
                              matches=patterns.get(inv, _END_TO_END.get(inv, VALUE_MISMATCH)),
                              modes=() if inv == "INV-KEYS-003" else ("padded",),
                              # end to end, whether a compared output is one the mask changes depends on the
                              # micro-batch cut (TorchTitan: 3 of 38 such cases failed)
                              certain=inv not in _END_TO_END)
                 for inv in sorted(invariants))


#: the micro-batch layer's end-to-end check (its own message: per sample, with the micro-batch sizes)
_END_TO_END = {"INV-MB-015": SAMPLE_MISMATCH}


#: where a response-only mask (r_i ones) changes an output that is read: any output at positions r_i .. n_i - 2 (a
#: prompt of 2 or more tokens; no output at a sequence's last token is read: spec.truth.rules.read_positions)
MASK_VISIBLE = When("a prompt of >= 2 tokens (an output at r_i .. n_i - 2 is read)",
                    lambda case: any(p >= 2 for p in case.prompt_lens))


def _per_sample_on_vocab(case) -> bool:
    temps = case.temperatures()
    return case.per_sample_temperature and not case.use_fused_kernels and case.batch_size >= 2 and \
        (case.batch_size != case.vocab or len(set(temps)) > 1)


#: a per-sample (B,) temperature divided into (n, V) / (B, L, V) logits as it is: it broadcasts on the vocab axis
PER_SAMPLE_ON_VOCAB = When("a per-sample temperature over B >= 2 samples (B != V: a shape error; B = V with unequal "
                           "values: vocab column j scaled by sample j's temperature)", _per_sample_on_vocab)
