"""What verl 0.9.1's Megatron engine gets wrong on a vision-language micro-batch (INV-MEG-006), as precise records.

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

__all__ = ["VISION_RECORDS", "fp8_vision_width_differs", "vision_widths"]

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
