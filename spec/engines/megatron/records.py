"""What verl 0.9.1's Megatron engine gets wrong, as precise records: on a vision-language micro-batch (INV-MEG-006,
below), and in its engine object's outputs (:data:`MEGATRON_ENGINE_RECORDS`: precision in the logits' dtype, the
unclamped temperature, the bucket's boundaries).

FP8 padding and the BSHD format (``use_remove_padding=False``): ``gptmodel_forward_model_engine`` pads the labels,
the temperature and the mask ``postprocess_bshd_engine`` reads with ``preprocess_bshd_engine(use_fp8_padding=True)``
(model_forward.py:409/461, util.py:694-703: the width also a multiple of ``128 x TP x CP / gcd(B, 128 x TP x CP)``),
but hands a vision-language model rows from ``build_vlm_attn_mask_bshd`` (model_forward.py:447, util.py:872-902),
which aligns the width to TP (x 2CP) only. The model's logits are then narrower than the labels:
``_lm_head_logits_processor`` stops at ``assert logits.shape[:2] == label.shape[:2]`` (transformer_impl.py:1205).
"""

from __future__ import annotations

import math

from ...protocol.known import KnownFailure, When
from ...protocol.profile import drawn_config
from ...truth.oracle import LOG_PROB_MIN_CLAMP
from ..kit.records import CANCELLATION, MISMATCH, UNCLAMPED
from ..verl.records import DISTILLATION_ASKED, SETTINGS_UNCHECKED, FP16_WIDE_VOCAB, FP16_ZERO_TEMPERATURE, LOW_DTYPES, fp16_records

__all__ = ["VISION_RECORDS", "MEGATRON_ENGINE_RECORDS", "fp8_vision_width_differs", "vision_widths"]

SIZES = (1, 2, 4)  # the TP and CP sizes INV-MEG-006 checks (spec/invariants/megatron.py)


def vision_widths(lens: tuple[int, ...], tp: int, cp: int) -> tuple[int, int]:
    """The row width ``build_vlm_attn_mask_bshd`` hands the model and the one ``preprocess_bshd_engine`` pads the
    labels to under FP8, by verl 0.9.1's arithmetic as the module docstring states it."""
    align = tp * cp * 2 if cp > 1 else tp
    rows = -(-max(lens) // align) * align
    fp8_total = 128 * tp * cp
    fp8_align = math.lcm(fp8_total // math.gcd(len(lens), fp8_total), align)
    return rows, -(-rows // fp8_align) * fp8_align


def fp8_vision_width_differs(case) -> bool:
    """Whether INV-MEG-006 draws FP8 for ``case`` (``seed // 3 % 4 == 1``, as the packing invariants) and, for some
    TP, CP in {1, 2, 4}, the vision rows are narrower than the FP8-padded labels."""
    if case.seed // 3 % 4 != 1:
        return False
    widths = (vision_widths(case.seq_lens, tp, cp) for tp in SIZES for cp in SIZES)
    return any(rows != labels for rows, labels in widths)


FP8_VISION_BSHD = When("FP8 padding drawn (seed // 3 % 4 == 1) and, for some TP, CP in {1, 2, 4}, the vision rows' "
                       "width (max length aligned to TP x 2CP) is no multiple of FP8's "
                       "128 x TP x CP / gcd(B, 128 x TP x CP)", fp8_vision_width_differs)

VISION_RECORDS = (
    KnownFailure("INV-MEG-006", "FP8 and BSHD with a vision-language model: build_vlm_attn_mask_bshd hands rows "
                 "aligned to TP x CP only while preprocess_bshd_engine pads the labels to FP8's width; the logits do "
                 "not line up with the labels (_lm_head_logits_processor's shape assertion); engine bug",
                 matches=r"^AssertionError: \[TP=\d+ CP=\d+ \w+, fp8\] BSHD rank \d+: the model is handed rows \d+ "
                         r"wide, the labels' BSHD layout is \d+ wide",
                 when=FP8_VISION_BSHD),
)


# -- the engine object (spec/engines/megatron/engine.py): forward_step on one rank ------------------------------------
_ENGINE = "(_lm_head_logits_processor, transformer_impl.py:1191-1241)"
LOW = When("bf16/fp16 logits (scaled in their dtype by _lm_head_logits_processor's logits.div_)",
           lambda c: getattr(c, "logits_dtype", "float32") != "float32")
UNCHUNKED = When("entropy not chunked (vocab_parallel_entropy returns the logits' dtype; chunked, a float32 buffer)",
                 lambda c: not c.entropy_chunk_size)


def _in(dtype: str) -> When:
    return When(f"{dtype} logits", lambda c: getattr(c, "logits_dtype", "float32") == dtype)


BUCKET = When("a static bucket (pad_to_length) that pads the packed row", lambda c: bool(c.pad_to_length))
CLAMPED = DISTILLATION_ASKED & When("a log_prob_min_clamp drawn",
                                    lambda c: drawn_config(c).get(LOG_PROB_MIN_CLAMP) is not None)
MASS_AFTER_CLAMP = ("verl's Megatron top-K KL computes student_mass and teacher_mass from the log-probs after "
                    "log_prob_min_clamp (exp(clamp) for every top-K id below it; FSDP's before the clamp): the logged "
                    "masses exceed the distributions' (1.28 for a teacher mass of 1); verl bug, fixed upstream by "
                    "verl#7723 (after 0.9.1)")
NO_CLAMP = ("_lm_head_logits_processor replaces a temperature <= 0 by 1e-8 (temperature[temperature <= 0] = 1e-8) but "
            "divides by a positive one below 1e-8 as it is: at T = 5e-9 the scaled logits are twice the contract's "
            "(which clamps at 1e-8); contract difference")
SUM_PI_ROUNDING = ("vocab_parallel_sum_pi_squared in the logits' dtype: exp(z - max) and both sums over the vocabulary "
                   "in bf16/fp16 on the logits scaled in that dtype, so two tokens whose large scaled logits round to "
                   "the same value share the mass (0.5 where the oracle has 1), beyond the first-order rounding the "
                   "declared precision allows; verl bug (precision: the contract computes in float32)")
ENTROPY_LOW = ("_VocabParallelEntropy in {dtype}: max + log(sum exp(z - max)) - sum(softmax(z) * z), terms of |z| rounded "
               "to that dtype whose difference is a small entropy (beyond the declared precision's rounding where the "
               "entropy's condition is small); verl bug (precision)")
BUCKET_BOUNDS = ("preprocess_thd_engine puts the static bucket's padding into the last sequence: cu_seqlens_q (and "
                 "_padded) end at the padded total with no boundary after the last real token (a causal model's real "
                 "tokens see none of it; max_seqlen_q grows by the padding); contract difference (the contract hands "
                 "a final boundary for tail padding)")
MEGATRON_ENGINE_RECORDS: tuple[KnownFailure, ...] = (
    SETTINGS_UNCHECKED,
    KnownFailure("INV-DEV-001", "returns entropy (unchunked) and sum_pi_squared in the logits' dtype "
                 f"{_ENGINE}, and a value head's values in the model's; log_probs and the top-K terms in float32 "
                 "(megatron-core upcasts); contract difference, the values are compared at that precision elsewhere",
                 when=LOW, raises=AssertionError,
                 matches=r"^AssertionError: output '(entropy|sum_pi_squared|values)' has dtype torch\.(bfloat16|float16), "
                         r"expected torch\.float32$"),
    *(KnownFailure("INV-VAL-002", ENTROPY_LOW.format(dtype=dtype), when=_in(dtype), certain=False,
                   raises=AssertionError, bound=(f"{dtype}_cancellation", 1.0),
                   matches=r"^AssertionError: 'entropy' of sequence \d+: at \(\d+,\) got .* \(\|diff\| .* > allowed")
      for dtype in LOW_DTYPES),
    KnownFailure("INV-VAL-002", "_VocabParallelEntropy: max + log(sum exp(z - max)) - sum(softmax(z) * z) cancels in "
                 "float32 (low T, large vocabularies); verl bug (precision)", when=CANCELLATION & ~LOW,
                 certain=False, raises=AssertionError, matches=MISMATCH),
    KnownFailure("INV-VAL-003", SUM_PI_ROUNDING, when=LOW, certain=False, raises=AssertionError, matches=MISMATCH),
    *(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv != "INV-SLICE-006")
      for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006")),
    KnownFailure("INV-VAL-004", NO_CLAMP + " (the top-K terms of the logits scaled so)", matches=MISMATCH,
                 when=UNCLAMPED & DISTILLATION_ASKED,
                 certain=False),
    KnownFailure("INV-CU-001", BUCKET_BOUNDS, modes=("packed",), raises=AssertionError,
                 matches=r"cu_seqlens \[[\d, ]+\], expected \[[\d, ]+\] for a packed row of \d+ tokens",
                 when=BUCKET),
    KnownFailure("INV-PAD-001", BUCKET_BOUNDS, modes=("packed",), raises=AssertionError, when=BUCKET,
                 matches=r"tail positions \[[\d, ]+\], expected them to restart at 0 \(else the pad joins the last "
                         r"sequence\)"),
    KnownFailure("INV-DEV-001", "verl's Megatron top-K KL (_VocabParallelKLDivergence.forward, "
                 "distillation/megatron/losses.py:198) returns overlap_count as int64 (overlap_mask.sum(dim=-1), a "
                 "count), nested as it comes; contract difference (the contract's outputs are float32), the count's "
                 "value is compared elsewhere", raises=AssertionError,
                 when=DISTILLATION_ASKED,
                 matches=r"^AssertionError: output 'overlap_count' has dtype torch\.int64, expected torch\.float32$"),
    *(KnownFailure("INV-VAL-004", MASS_AFTER_CLAMP, when=CLAMPED, certain=False, raises=AssertionError,
                   matches=r"'(student_mass|teacher_mass)' of sequence \d+: at \(\d+,\) got .* expected .* \(\|diff\|"),),
    KnownFailure("INV-FLAG-005", "MegatronEngineWithValueHead.forward_step never reads pad_mode (the LM head's raises "
                 "NotImplementedError): a left_right or right micro-batch is packed as if it were no_padding; verl bug",
                 raises=AssertionError, matches=r"^AssertionError: prepare_model_inputs with pad_mode=\w+ \(.*\) was "
                                                r"accepted silently; the contract makes it an error$"),
    *fp16_records(FP16_ZERO_TEMPERATURE, "casts the temperature to the logits' dtype (temperature.to(logits.dtype), "
                  "after T <= 0 became 1e-8): in float16 a temperature below 3e-8 is 0 and the scaled logits inf/NaN; "
                  "verl bug (the contract clamps at 1e-8 in float32)"),
    *fp16_records(FP16_WIDE_VOCAB, "takes the entropy and sum_pi_squared in the logits' dtype: in float16 the sum over "
                  "a vocabulary above 65,504 ids overflows (torch's CPU kernel accumulates in float16); verl bug "
                  "(precision)"),
)
