"""Planted bugs: small, plausible mistakes in an otherwise correct engine (impl).

Each entry names the invariant(s) that must reject it; ``tests/test_power.py`` asserts
that they do under the ``ci`` profile, and ``spec/README.md`` records the shrunk
counterexample each one produces. The first two are the seeds' historical verl bugs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import impl

from ..impl_engine import ImplEngine
from . import helper_bugs as H
from . import inputs_bugs as I
from . import outputs_bugs as O
from . import settings_bugs as S
from .inputs_bugs import LossMaskAttention

__all__ = ["PlantedBug", "PLANTED", "planted_engine", "LossMaskAttention"]


@dataclass(frozen=True)
class PlantedBug:
    name: str
    caught_by: tuple[str, ...]
    lm: type | None = None
    value: type | None = None
    helpers: tuple[tuple[str, Callable], ...] = ()

    @property
    def doc(self) -> str:
        source = self.lm or self.value or dict(self.helpers)[self.helpers[0][0]]
        return (source.__doc__ or "").strip()


PLANTED: dict[str, PlantedBug] = {bug.name: bug for bug in (
    PlantedBug("loss_mask_attention", ("INV-MASK-001", "INV-MASK-003", "INV-VAL-001", "INV-KEYS-003"), lm=I.LossMaskAttention),
    PlantedBug("drop_distillation_padded", ("INV-KEYS-001", "INV-VAL-004"), lm=O.DropDistillationPadded),
    PlantedBug("mask_off_by_one", ("INV-MASK-001", "INV-VAL-002"), lm=I.MaskOffByOne),
    PlantedBug("sum_pi_squared_missing_padded", ("INV-KEYS-002",), lm=O.SumPiSquaredMissingPadded),
    PlantedBug("shard_roll", ("INV-LABEL-002", "INV-SP-001"), lm=I.ShardRoll),
    PlantedBug("no_temperature_padded", ("INV-TEMP-001", "INV-VAL-001"), lm=O.NoTemperaturePadded),
    PlantedBug("double_temperature", ("INV-TEMP-001", "INV-VAL-001"), lm=O.DoubleTemperature),
    PlantedBug("first_sample_temperature", ("INV-TEMP-001", "INV-TEMP-004"), lm=I.FirstSampleTemperature),
    PlantedBug("fused_tensor_temperature_accepted", ("INV-ERR-003",), lm=I.FusedTensorTemperatureAccepted),
    PlantedBug("bucket_topk_accepted", ("INV-ERR-002",), lm=I.BucketTopKAccepted),
    PlantedBug("bucket_positions_continue", ("INV-PAD-001",), lm=I.BucketPositionsContinue),
    PlantedBug("strip_pad_from_head", ("INV-SP-002",), lm=O.StripPadFromHead),
    PlantedBug("global_max_shift", ("INV-LEAK-001",), lm=O.GlobalMaxShift),
    PlantedBug("mutate_logits", ("INV-MUT-002",), lm=O.MutateLogits),
    PlantedBug("value_trailing_dim", ("INV-VAL-005",), value=O.ValueTrailingDim),
    PlantedBug("slice_without_shift", ("INV-SLICE-002", "INV-SLICE-003"),
               helpers=(("no_padding_2_padding", H.slice_without_shift),)),
    PlantedBug("slice_masked_by_multiplication", ("INV-SLICE-003",),
               helpers=(("no_padding_2_padding", H.slice_masked_by_multiplication),)),
    PlantedBug("slice_lengths_from_loss_mask_sum", ("INV-SLICE-002",),
               helpers=(("no_padding_2_padding", H.slice_lengths_from_loss_mask_sum),)),
    PlantedBug("left_right_mutating", ("INV-MUT-003",), helpers=(("left_right_2_no_padding", H.left_right_mutating),)),
    PlantedBug("left_right_as_nested_positions", ("INV-DENSE-002",),
               helpers=(("left_right_2_no_padding", H.left_right_as_nested_positions),)),
    PlantedBug("mask_as_bool", ("INV-MASK-002",), lm=I.MaskAsBool),
    PlantedBug("mask_helper_ignores_width", ("INV-MASK-004",),
               helpers=(("build_attention_mask_from_nested", H.mask_helper_ignores_width),)),
    PlantedBug("pad_with_zero", ("INV-INPUT-001",), lm=I.PadWithZero),
    PlantedBug("mrope_padded_not_transposed", ("INV-POS-001",), lm=I.MropePaddedNotTransposed),
    PlantedBug("packed_positions_global", ("INV-POS-002", "INV-VAL-001"), lm=I.PackedPositionsGlobal),
    PlantedBug("labels_not_rolled", ("INV-LABEL-001", "INV-VAL-001"), lm=I.LabelsNotRolled),
    PlantedBug("writes_flag_into_batch", ("INV-MUT-001",), lm=I.WritesFlagIntoBatch),
    PlantedBug("pad_mode_unchecked", ("INV-ERR-001",), lm=I.PadModeUnchecked),
    PlantedBug("fused_temperature_tensor", ("INV-FUSED-001",), lm=I.FusedTemperatureTensor),
    PlantedBug("float_temperature_ignored", ("INV-TEMP-002", "INV-VAL-001"), lm=I.FloatTemperatureIgnored),
    PlantedBug("temperature_by_sorted_lengths", ("INV-BATCH-002", "INV-BATCH-001", "INV-TEMP-001"),
               lm=I.TemperatureBySortedLengths),
    PlantedBug("dense_outputs_padded", ("INV-LAYOUT-001",), lm=O.DenseOutputsPadded),
    PlantedBug("outputs_float64", ("INV-DEV-001",), lm=O.OutputsFloat64),
    PlantedBug("nan_to_num_then_global_shift", ("INV-LEAK-002",), lm=O.NanToNumThenGlobalShift),
    PlantedBug("identity_shortcut", ("INV-TEMP-003",), lm=O.IdentityShortcut),
    PlantedBug("sum_pi_not_squared", ("INV-VAL-003",), lm=O.SumPiNotSquared),
    PlantedBug("slice_ignores_width_flag", ("INV-SLICE-001",),
               helpers=(("no_padding_2_padding", H.slice_ignores_width_flag),)),
    PlantedBug("response_from_nested_no_shift", ("INV-SLICE-004",),
               helpers=(("response_from_nested", H.response_from_nested_no_shift),)),
    PlantedBug("response_to_nested_right_aligned", ("INV-SLICE-005",),
               helpers=(("response_to_nested", H.response_to_nested_right_aligned),)),
    PlantedBug("left_right_keeps_prompt_padding", ("INV-DENSE-001",),
               helpers=(("left_right_2_no_padding", H.left_right_keeps_prompt_padding),)),
    PlantedBug("left_right_loss_mask_ones", ("INV-DENSE-003",),
               helpers=(("left_right_2_no_padding", H.left_right_loss_mask_ones),)),
    PlantedBug("left_right_drops_teacher", ("INV-DENSE-004",),
               helpers=(("left_right_2_no_padding", H.left_right_drops_teacher),)),
    PlantedBug("left_right_drops_width_flag", ("INV-DENSE-005",),
               helpers=(("left_right_2_no_padding", H.left_right_drops_width_flag),)),
    PlantedBug("cu_seqlens_not_extended", ("INV-CU-001",), lm=I.CuSeqlensNotExtended),
    PlantedBug("roll_after_padding", ("INV-LABEL-003",), lm=I.RollAfterPadding),
    PlantedBug("chunk_drops_tail", ("INV-CHUNK-001",), lm=O.ChunkDropsTail),
    PlantedBug("frees_output_args", ("INV-MUT-004",), lm=O.FreesOutputArgs),
    PlantedBug("value_head_divides_by_temperature", ("INV-VAL-005",), value=O.ValueHeadDividesByTemperature),
    PlantedBug("entropy_flag_defaults_true", ("INV-FLAG-001",), lm=S.EntropyFlagDefaultsTrue),
    PlantedBug("remove_padding_is_true", ("INV-FLAG-002",), lm=S.RemovePaddingIsTrue),
    PlantedBug("flags_by_truthiness", ("INV-FLAG-003",), lm=S.FlagsByTruthiness),
    PlantedBug("chunk_size_or_none", ("INV-SET-001",), lm=S.ChunkSizeOrNone),
    PlantedBug("slice_through_float", ("INV-DTYPE-001",), helpers=(("no_padding_2_padding", S.slice_through_float),)),
    PlantedBug("dense_lengths_from_mask_sum", ("INV-RESP-001",),
               helpers=(("no_padding_2_padding", S.dense_lengths_from_mask_sum),)),
)}


class PlantedEngine(ImplEngine):
    """impl with one planted bug."""

    def __init__(self, bug: PlantedBug):
        self.bug = bug
        self.name = f"planted:{bug.name}"
        self.engine_classes = {"lm": bug.lm or impl.LMHeadEngine, "value": bug.value or impl.ValueHeadEngine}

    def helper(self, name: str) -> Callable | None:
        return dict(self.bug.helpers).get(name) or super().helper(name)


def planted_engine(name: str) -> PlantedEngine:
    if name not in PLANTED:
        raise ValueError(f"unknown planted bug {name!r}; known: {sorted(PLANTED)}")
    return PlantedEngine(PLANTED[name])
