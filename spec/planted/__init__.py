"""Planted bugs: small, plausible mistakes in an otherwise correct engine (impl).

Each entry names the invariant(s) that must reject it; ``tests/test_power.py`` asserts
that they do under the ``ci`` profile, and ``spec/README.md`` records the shrunk
counterexample each one produces. The first two are the seeds' historical verl bugs.
Harmless engines (differences no consumer reads, which the verdict must pass) are in :mod:`.harmless`.
May import protocol, truth, cases and engines (the bugs are planted in impl's adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import impl

from ..engines.impl.adapter import ImplEngine
from ..engines.verl.records import KNOWN_BUGS as VERL_KNOWN
from ..engines.verl.records import LOW_PRECISION_RECORDS, SUM_PI_SQUARED_CANCELLATION, verl_precision
from ..protocol.engine import ShardLayout
from ..protocol.known import KnownFailure
from . import companion_bugs as CB
from . import config_bugs as G
from . import context_bugs as C
from . import dropin_bugs as D
from . import fault_bugs as F
from . import helper_bugs as H
from . import inputs_bugs as I
from . import media_bugs as MM
from . import megatron_bugs as M
from . import microbatch_bugs as MB
from . import outputs_bugs as O
from . import quiet_bugs as Q
from . import rank_bugs as R
from . import settings_bugs as S
from . import state_bugs as T
from . import step_bugs as SB
from .inputs_bugs import LossMaskAttention

__all__ = ["PlantedBug", "PLANTED", "planted_engine", "LossMaskAttention"]


@dataclass(frozen=True)
class PlantedBug:
    name: str
    caught_by: tuple[str, ...]
    lm: type | None = None
    value: type | None = None
    helpers: tuple[tuple[str, Callable], ...] = ()
    #: a layout deviation (harmless to consumers): caught by layout-profile invariants only
    layout: bool = False
    #: for a quiet bug: the one condition under which it shows
    quiet: str = ""
    packer: type | None = None  # a Megatron-style packer (spec/truth/megatron_packing.py) with the bug
    #: known-failure records the engine claims (as a real engine with a documented deviation does): the bug
    #: must be caught although they apply to its region
    known: tuple[KnownFailure, ...] = ()
    #: a micro-batch layer with the bug: impl's layer in, the planted one out (spec/planted/microbatch_bugs.py)
    microbatch: Callable | None = None
    #: the engine's own configuration switches the bug hides behind (``EngineUnderTest.config_space``)
    config: tuple = ()
    #: the engine's declared precision per output key (``EngineUnderTest.precision``), where not the contract's
    precision: Callable | None = None
    #: a training step with the bug: impl's step layer in, the planted one out (spec/planted/step_bugs.py)
    step: Callable | None = None
    #: the engine's own companion with the bug: ``(case, sp_size, sp_rank) -> logits processor or None``
    #: (``EngineUnderTest.logits_processor``; None: the suite's stand-in); its switches are among :attr:`config`
    companion: Callable | None = None

    @property
    def doc(self) -> str:
        source = self.lm or self.value or self.packer or self.microbatch or self.step \
            or getattr(self.companion, "__self__", None) \
            or dict(self.helpers)[self.helpers[0][0]]
        return (source.__doc__ or "").strip()


PLANTED: dict[str, PlantedBug] = {bug.name: bug for bug in (
    PlantedBug("loss_mask_attention", ("INV-MASK-001", "INV-MASK-003", "INV-VAL-001", "INV-KEYS-003", "INV-SLICE-006"),
               lm=I.LossMaskAttention),
    PlantedBug("drop_distillation_padded", ("INV-KEYS-001", "INV-VAL-004"), lm=O.DropDistillationPadded),
    PlantedBug("mask_off_by_one", ("INV-MASK-001",), lm=I.MaskOffByOne),
    PlantedBug("routes_one_token_late", ("INV-ROUTE-001",), lm=I.RoutesOneTokenLate, config=(I.ROUTES,)),
    PlantedBug("record_pad_at_head", ("INV-ROUTE-002",), lm=O.RecordPadAtHead, config=(O.RECORDS,),
               quiet="router replay's R2 record with tail padding (a static bucket or sequence parallelism)"),
    PlantedBug("record_one_token_late", ("INV-ROUTE-002",), lm=O.RecordOneTokenLate, config=(O.RECORDS,)),
    PlantedBug("sum_pi_squared_missing_padded", ("INV-KEYS-002",), lm=O.SumPiSquaredMissingPadded),
    PlantedBug("shard_roll", ("INV-LABEL-002", "INV-SP-001"), lm=I.ShardRoll),
    PlantedBug("no_temperature_padded", ("INV-TEMP-001", "INV-VAL-001"), lm=O.NoTemperaturePadded),
    PlantedBug("double_temperature", ("INV-TEMP-001", "INV-VAL-001"), lm=O.DoubleTemperature),
    PlantedBug("first_sample_temperature", ("INV-TEMP-001", "INV-TEMP-004", "INV-TEMP-005"),
               lm=I.FirstSampleTemperature),
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
    PlantedBug("pad_with_zero", ("INV-INPUT-002",), lm=I.PadWithZero, layout=True),
    PlantedBug("padded_ids_left_aligned", ("INV-INPUT-001", "INV-VAL-001"), lm=I.PaddedIdsLeftAligned),
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
    PlantedBug("roll_after_padding", ("INV-LABEL-003",), lm=I.RollAfterPadding, layout=True),
    PlantedBug("chunk_drops_tail", ("INV-CHUNK-001",), lm=O.ChunkDropsTail),
    PlantedBug("frees_output_args", ("INV-MUT-004",), lm=O.FreesOutputArgs),
    PlantedBug("value_head_divides_by_temperature", ("INV-VAL-005",), value=O.ValueHeadDividesByTemperature),
    # layout deviations (harmless to consumers): only the layout profile's invariants see them
    PlantedBug("tail_ids_pad_token", ("INV-PAD-002",), lm=I.TailIdsPadToken, layout=True),
    PlantedBug("padded_positions_fill_one", ("INV-POS-003",), lm=I.PaddedPositionsFillOne, layout=True),
    PlantedBug("fused_without_return_dict", ("INV-FUSED-002",), lm=I.FusedWithoutReturnDict, layout=True),
    PlantedBug("cu_seqlens_without_cpu_copy", ("INV-CU-002",), lm=I.CuSeqlensWithoutCpuCopy, layout=True),
    # quiet bugs: each shows only under one condition (spec/planted/quiet_bugs.py)
    PlantedBug("log_softmax_in_logits_dtype", ("INV-VAL-001", "INV-SLICE-002"), lm=Q.LogSoftmaxInLogitsDtype,
               quiet="bf16/fp16 logits"),
    PlantedBug("entropy_logsumexp_minus_sum", ("INV-VAL-002",), lm=Q.EntropyLogsumexpMinusSum,
               quiet="T < 0.1"),
    # a claimed numerical excuse (verl's float32-cancellation records) reaches only as far as its bound
    PlantedBug("entropy_untempered_at_low_temperature", ("INV-VAL-002",), lm=Q.EntropyUntemperedAtLowTemperature,
               quiet="T < 0.1, where the engine claims verl's entropy cancellation record",
               known=tuple(r for r in VERL_KNOWN["*"] if r.invariant == "INV-VAL-002")),
    PlantedBug("sum_pi_squared_tenfold_at_low_temperature", ("INV-VAL-003",),
               lm=Q.SumPiSquaredTenfoldAtLowTemperature,
               quiet="T < 0.1 or V > 32,768, where the engine claims verl's sum_pi_squared cancellation record",
               known=(SUM_PI_SQUARED_CANCELLATION,)),
    PlantedBug("temperature_clamp_missing", ("INV-TEMP-006",), lm=Q.TemperatureClampMissing,
               quiet="T below 1e-8"),
    PlantedBug("temperature_in_logits_dtype", ("INV-VAL-001", "INV-TEMP-001"), lm=Q.TemperatureInLogitsDtype,
               quiet="bf16/fp16 logits, T not representable"),
    PlantedBug("scale_before_upcast", ("INV-VAL-001", "INV-VAL-002"), lm=Q.ScaleBeforeUpcast,
               quiet="bf16/fp16 logits"),
    PlantedBug("last_partial_chunk_untempered", ("INV-VAL-001", "INV-CHUNK-001"), lm=Q.LastPartialChunkUntempered,
               quiet="a partial last chunk, T != 1"),
    PlantedBug("inplace_div_float32_logits", ("INV-MUT-002",), lm=Q.InplaceDivFloat32Logits,
               quiet="float32 logits, T != 1"),
    PlantedBug("labels_masked_at_pad_id", ("INV-LABEL-001", "INV-VAL-001"), lm=Q.LabelsMaskedAtPadId,
               quiet="pad id (!= 0) among real tokens"),
    PlantedBug("padded_mask_from_pad_id", ("INV-MASK-001", "INV-MASK-003"), lm=Q.PaddedMaskFromPadId,
               quiet="pad id among real tokens"),
    PlantedBug("label_ids_as_uint16", ("INV-LABEL-001", "INV-VAL-001"), lm=Q.LabelIdsAsUint16,
               quiet="ids above 65,535"),
    PlantedBug("label_ids_as_int16", ("INV-VAL-001",), lm=Q.LabelIdsAsInt16,
               quiet="vocabularies of 32,769 .. 65,536 ids (ids 32,768 .. 65,535)"),
    PlantedBug("routed_experts_as_uint8", ("INV-DENSE-007",),
               helpers=(("left_right_2_no_padding", H.left_right_routed_experts_uint8),),
               quiet="MoE router replay of more than 256 experts"),
    PlantedBug("routed_experts_top1_squeezed", ("INV-DENSE-007",),
               helpers=(("left_right_2_no_padding", H.left_right_routed_top1_squeezed),),
               quiet="MoE router replay with top-1 routing or one MoE layer"),
    PlantedBug("positions_clamped_at_2048", ("INV-POS-002", "INV-POS-001", "INV-VAL-001"),
               lm=Q.PositionsClampedAt2048, quiet="sequences over 2,048 tokens"),
    PlantedBug("roll_in_2048_chunks", ("INV-LABEL-001",), lm=Q.RollIn2048Chunks, quiet="total_nnz > 2,048"),
    PlantedBug("labels_from_storage_start", ("INV-LABEL-001",), lm=Q.LabelsFromStorageStart,
               quiet="a micro-batch split from a mini-batch (values at a storage offset)"),
    PlantedBug("temperature_table_of_eight", ("INV-TEMP-001",), lm=Q.TemperatureTableOfEight,
               quiet="B > 8"),
    PlantedBug("left_right_valid_by_pad_id", ("INV-DENSE-001",),
               helpers=(("left_right_2_no_padding", Q.left_right_valid_by_pad_id),), quiet="pad id among real tokens"),
    PlantedBug("left_right_prompts_left_aligned", ("INV-DENSE-006",),
               helpers=(("left_right_2_no_padding", Q.left_right_prompts_left_aligned),),
               quiet="left-padded prompts of different lengths"),
    PlantedBug("left_right_response_len_from_mask_sum", ("INV-DENSE-006",),
               helpers=(("left_right_2_no_padding", Q.left_right_response_len_from_mask_sum),),
               quiet="holes in the response mask"),
    PlantedBug("left_right_routed_experts_unmasked", ("INV-DENSE-007",),
               helpers=(("left_right_2_no_padding", Q.left_right_routed_experts_unmasked),),
               quiet="left-padded prompts"),
    PlantedBug("left_right_runs_from_column_counts", ("INV-DROPIN-001",),
               helpers=(("left_right_2_no_padding", D.left_right_runs_from_column_counts),)),
    PlantedBug("left_right_split_from_columns", ("INV-DROPIN-001",),
               helpers=(("left_right_2_no_padding", D.left_right_split_from_columns),)),
    PlantedBug("left_right_loss_mask_keeps_stray_marks", ("INV-DROPIN-002",),
               helpers=(("left_right_2_no_padding", D.left_right_loss_mask_keeps_stray_marks),)),
    PlantedBug("zigzag_halves_swapped", ("INV-MEG-001", "INV-MEG-003", "INV-MEG-005"), packer=M.ZigzagHalvesSwapped),
    PlantedBug("align_ignores_tp", ("INV-MEG-002",), packer=M.AlignIgnoresTensorParallel),
    PlantedBug("roll_local_shard", ("INV-MEG-004", "INV-MEG-008"), packer=M.RollLocalShard),
    PlantedBug("mtp_mask_unrolled", ("INV-MEG-008",), packer=M.MtpLossMaskUnrolled),
    PlantedBug("routes_packed_unaligned", ("INV-MEG-009",), packer=M.RoutesPackedUnaligned),
    PlantedBug("replay_mask_response_only", ("INV-MEG-009",), packer=M.ReplayMaskResponseOnly),
    PlantedBug("record_tp_parts_reversed", ("INV-MEG-009",), packer=M.RecordTpPartsReversed, quiet="TP > 1"),
    PlantedBug("positions_continue", ("INV-MEG-003",), packer=M.PositionsContinue),
    PlantedBug("unpack_from_unpadded_offsets", ("INV-MEG-001",), packer=M.UnpackFromUnpaddedOffsets),
    PlantedBug("later_stage_unpadded_boundaries", ("INV-MEG-007",), packer=M.LaterStageUnpaddedBoundaries),
    PlantedBug("vision_packed_at_unpadded_offsets", ("INV-MEG-006",), packer=M.VisionPackedAtUnpaddedOffsets),
    PlantedBug("vision_features_longest_first", ("INV-MEG-006",), packer=M.VisionFeaturesLongestFirst,
               quiet="a vision-language micro-batch whose samples with media are out of length order"),
    # on real ranks (spec/execute/ranks.py, spec/invariants/ranks.py)
    PlantedBug("rank_roll_after_slice", ("INV-RANK-002", "INV-RANK-001", "INV-RANK-007", "INV-RANK-008"), lm=R.RollAfterSlice),
    PlantedBug("critic_gather_reversed", ("INV-RANK-009", "INV-VAL-005"), value=R.CriticGatherReversed,
               quiet="the value head under sequence parallelism (sp > 1): a PPO critic under Ulysses SP"),
    PlantedBug("rank_pad_when_divisible", ("INV-RANK-003",), lm=R.PadWhenDivisible),
    # faults: each rejected by a failed check, never a suite error, within the run's fault budget
    PlantedBug("critic_values_short_on_ranks", ("INV-RANK-009",), value=F.CriticValuesShortOnRanks,
               quiet="real ranks, rank 1's values"),
    PlantedBug("rank_dies_on_uneven_shard", ("INV-RANK-002",), lm=F.RankDiesOnUnevenShard,
               quiet="real ranks, a packed row that does not divide sp"),
    PlantedBug("entropy_rounded_on_chunked_path", ("INV-DEV-001",), lm=F.EntropyRoundedOnChunkedPath,
               precision=verl_precision, known=tuple(r for r in LOW_PRECISION_RECORDS if r.invariant == "INV-DEV-001"),
               quiet="bf16/fp16 logits, packed, entropy chunked"),
    PlantedBug("entropy_rounded_behind_log_probs", ("INV-DEV-001",), lm=F.EntropyRoundedBehindLogProbs,
               precision=verl_precision, known=tuple(r for r in LOW_PRECISION_RECORDS if r.invariant == "INV-DEV-001"),
               quiet="bf16/fp16 logits, packed, entropy chunked, behind log_probs in the logits' dtype (declared)"),
    PlantedBug("rank_gather_even_share", ("INV-RANK-001", "INV-RANK-005"), lm=R.GatherEvenShare),
    PlantedBug("rank_temperature_sliced_logits_not", ("INV-RANK-004",), lm=R.TemperatureSlicedLogitsNot),
    PlantedBug("rank_temperature_not_sliced", ("INV-RANK-006",), lm=R.TemperatureNotSliced),
    PlantedBug("rank_sp_rank_from_global_rank", ("INV-RANK-002", "INV-RANK-001"), lm=R.SpRankFromGlobalRank,
               quiet="an SP group that starts at a global rank other than k * sp or interleaves (sp_groups=)"),
    PlantedBug("entropy_flag_defaults_true", ("INV-FLAG-001",), lm=S.EntropyFlagDefaultsTrue),
    PlantedBug("remove_padding_is_true", ("INV-FLAG-002",), lm=S.RemovePaddingIsTrue),
    PlantedBug("flags_by_truthiness", ("INV-FLAG-003",), lm=S.FlagsByTruthiness),
    PlantedBug("chunk_size_or_none", ("INV-SET-001",), lm=S.ChunkSizeOrNone),
    PlantedBug("slice_through_float", ("INV-DTYPE-001",), helpers=(("no_padding_2_padding", S.slice_through_float),)),
    PlantedBug("dense_lengths_from_mask_sum", ("INV-RESP-001",),
               helpers=(("no_padding_2_padding", S.dense_lengths_from_mask_sum),)),
    # an engine object kept across micro-batches (spec/invariants/state.py)
    PlantedBug("mask_cached_by_shape", ("INV-BATCH-003",), lm=T.MaskCachedByShape,
               quiet="a micro-batch of the same (B, L) with other lengths before, through the same engine object"),
    PlantedBug("log_probs_in_reused_buffer", ("INV-MUT-005",), lm=T.LogProbsInReusedBuffer,
               quiet="a later micro-batch through the same engine object"),
    PlantedBug("entropy_flag_read_once", ("INV-BATCH-003",), lm=T.EntropyFlagReadOnce,
               quiet="an earlier micro-batch with the other calculate_entropy, through the same engine object"),
    # the micro-batch layer (spec/invariants/microbatch.py)
    PlantedBug("restore_off_by_one_when_reordered", ("INV-MB-007", "INV-MB-015"),
               microbatch=MB.restore_off_by_one_when_reordered,
               quiet="the balancing put the samples out of order (two or more micro-batches)"),
    PlantedBug("budget_check_exclusive", ("INV-MB-003", "INV-MB-004"), microbatch=MB.budget_check_exclusive,
               quiet="a sample, group or mini-batch of exactly max_token_len tokens"),
    PlantedBug("equal_lengths_stacked_dense", ("INV-MB-013",), microbatch=MB.equal_lengths_stacked_dense,
               quiet="every sample of one length (or B = 1)"),
    PlantedBug("micro_batches_drop_flags", ("INV-MB-008",), microbatch=MB.micro_batches_drop_flags),
    PlantedBug("groups_split", ("INV-MB-002",), microbatch=MB.groups_split,
               quiet="force_group_size > 1 and a budget that splits the mini-batch"),
    PlantedBug("dp_count_not_synchronised", ("INV-MB-005",), microbatch=MB.dp_count_not_synchronised,
               quiet="data-parallel ranks whose own micro-batch counts differ"),
    PlantedBug("micro_batch_rows_rotated", ("INV-MB-001", "INV-MB-008"), microbatch=MB.micro_batch_rows_rotated),
    PlantedBug("chunks_reversed", ("INV-MB-009",), microbatch=MB.chunks_reversed),
    PlantedBug("concat_drops_flags", ("INV-MB-010",), microbatch=MB.concat_drops_flags),
    PlantedBug("index_select_sorted", ("INV-MB-011",), microbatch=MB.index_select_sorted,
               quiet="a selection not in ascending order"),
    PlantedBug("nested_from_list_by_torch", ("INV-MB-012",), microbatch=MB.nested_from_list_by_torch,
               quiet="mRoPE positions of equal lengths or B = 1"),
    PlantedBug("fix_positions_by_unbind", ("INV-MB-014",), microbatch=MB.fix_positions_by_unbind,
               quiet="mRoPE positions of equal lengths or B = 1"),
    PlantedBug("fixed_path_drops_remainder", ("INV-MB-006",), microbatch=MB.fixed_path_drops_remainder,
               quiet="a batch size micro_batch_size_per_gpu x force_group_size does not divide"),
    # the layer as a trainer calls it beyond the forward pass (spec/invariants/microbatch_trainer.py)
    PlantedBug("balance_ignores_equal_size", ("INV-MB-016",), microbatch=MB.balance_ignores_equal_size,
               quiet="equal_size=True (balance_batch over data-parallel ranks) with lengths that differ"),
    PlantedBug("losses_only_with_model_output", ("INV-MB-017",), microbatch=MB.losses_only_with_model_output,
               quiet="a training step whose micro-batches return loss and metrics but no model_output"),
    PlantedBug("dense_tokens_counted_by_response", ("INV-MB-018",), microbatch=MB.dense_tokens_counted_by_response,
               quiet="a padded mini-batch under a budget its prompts then overfill"),
    PlantedBug("index_tensor_deduplicated", ("INV-MB-019",), microbatch=MB.index_tensor_deduplicated,
               quiet="indices handed as a tensor, not in ascending order"),
    # the settings an engine's profile declares unsupported, and fused kernels with distillation
    PlantedBug("outputs_ignore_pad_mode", ("INV-FLAG-004", "INV-FLAG-005"), lm=S.OutputsIgnorePadMode,
               value=S.ValueOutputsIgnorePadMode,
               quiet="prepare_model_outputs called with a pad_mode other than no_padding (the inputs step refuses it)"),
    PlantedBug("fused_distillation_dropped", ("INV-FUSED-003",), lm=S.FusedDistillationDropped,
               quiet="fused kernels with top-K distillation"),
    # the autograd context a trainer calls the preparation in (spec/planted/context_bugs.py)
    PlantedBug("inplace_div_without_grad", ("INV-MUT-002",), lm=C.InplaceDivWithoutGrad,
               quiet="torch.no_grad() or torch.inference_mode(), T != 1"),
    PlantedBug("outputs_cached_in_inference_mode", ("INV-BATCH-003",), lm=C.OutputsCachedInInferenceMode,
               quiet="torch.inference_mode(), a micro-batch of the same shape before, through the same engine object"),
    PlantedBug("entropy_detached_with_grad", ("INV-GRAD-001",), lm=C.EntropyDetachedWithGrad,
               quiet="grad enabled (the policy update), entropy asked"),
    PlantedBug("restore_skipped_without_grad", ("INV-MB-007",), microbatch=MB.restore_skipped_without_grad,
               quiet="torch.no_grad() or torch.inference_mode(), the balancing put the samples out of order"),
    # behind an engine's own configuration switch (spec/planted/config_bugs.py): a flag and a size
    PlantedBug("checkpointed_entropy_untempered", ("INV-VAL-002",), lm=G.CheckpointedEntropyUntempered,
               quiet="the engine's entropy_checkpointing switch on, T != 1",
               config=(G.SWITCHES[G.CheckpointedEntropyUntempered],)),
    PlantedBug("vocab_chunked_logsumexp", ("INV-VAL-001",), lm=G.VocabChunkedLogsumexp,
               quiet="the engine's vocab_chunk switch set, a larger logit in a later chunk",
               config=(G.SWITCHES[G.VocabChunkedLogsumexp],)),
    PlantedBug("tail_multiple_over_padded", ("INV-PAD-003",), lm=G.TailMultipleOverPadded,
               quiet="the engine's pad_to_multiple_of switch set, a packed length not a multiple of it",
               config=(G.SWITCHES[G.TailMultipleOverPadded],)),
    PlantedBug("bf16_path_skips_temperature", ("INV-VAL-001",), lm=G.Bf16PathSkipsTemperature,
               quiet="bf16 logits, T != 1, compared at the bf16 precision the engine declares",
               precision=G.low_precision_log_probs),
    # the training step (spec/planted/step_bugs.py, spec/invariants/step.py)
    PlantedBug("loss_normalized_per_micro_batch", ("INV-STEP-004", "INV-STEP-003"),
               step=SB.loss_normalized_per_micro_batch,
               quiet="two or more micro-batches (or ranks) whose token counts differ"),
    PlantedBug("token_count_from_one_rank", ("INV-STEP-004", "INV-STEP-003"), step=SB.token_count_from_one_rank,
               quiet="data-parallel ranks (dp > 1, real ranks) and a token-mean loss"),
    PlantedBug("dp_size_from_world", ("INV-STEP-004", "INV-STEP-003"), step=SB.dp_size_from_world,
               quiet="a DP group smaller than the world (dp = 2 on the suite's pool of 4 real ranks)"),
    PlantedBug("scale_from_padded_width", ("INV-STEP-004", "INV-STEP-003"), step=SB.scale_from_padded_width,
               quiet="seq-mean-token-sum-norm without a loss_scale_factor, a micro-batch narrower than the longest "
                     "response"),
    PlantedBug("padding_micro_batch_missing_key", ("INV-STEP-002",), step=SB.padding_micro_batch_missing_key,
               quiet="data-parallel ranks (real ranks) whose own micro-batch counts differ (a token budget)"),
    PlantedBug("restore_after_losses_reordered", ("INV-STEP-001",), step=SB.restore_after_losses_reordered,
               quiet="two or more micro-batches whose losses are not in descending order"),
    # in the engine's own companion, the top-K distillation processor it hands itself (spec/planted/companion_bugs.py)
    PlantedBug("chunked_topk_drops_last_chunk", ("INV-VAL-004",), companion=CB.ChunkedTopKDropsLastChunk.companion,
               quiet="the engine's own top-K processor chunked (its topk_chunk switch), the chunk not dividing the "
                     "tokens", config=(CB.SWITCHES[CB.ChunkedTopKDropsLastChunk],)),
    # images and videos (spec/planted/media_bugs.py): quiet, each shows only on a vision-language micro-batch
    PlantedBug("media_last_sample_dropped", ("INV-MM-001", "INV-MM-002"), lm=MM.MediaLastSampleDropped,
               quiet="a micro-batch with images"),
    PlantedBug("media_reversed", ("INV-MM-001", "INV-MM-002"), lm=MM.MediaReversed,
               quiet="two samples or more with images"),
    PlantedBug("media_shifted_one_group", ("INV-MM-001", "INV-MM-002"), lm=MM.MediaShiftedOneGroup,
               quiet="images of two merged groups or more"),
    PlantedBug("media_lost_padded", ("INV-MM-001", "INV-MM-002"), lm=MM.MediaLostPadded,
               quiet="a padded micro-batch with images"),
    PlantedBug("media_grids_sorted", ("INV-MM-001", "INV-MM-002"), lm=MM.MediaGridsSorted,
               quiet="images of unequal grids out of size order"),
    # audio clips (spec/planted/media_bugs.py): quiet, each shows only where samples' clips differ in length
    PlantedBug("audio_mask_padded_with_ones", ("INV-MM-003", "INV-MM-004"), lm=MM.AudioMaskPaddedWithOnes,
               quiet="audio clips of unequal lengths in one micro-batch"),
    PlantedBug("audio_clips_cut_to_shortest", ("INV-MM-003", "INV-MM-004"), lm=MM.AudioClipsCutToShortest,
               quiet="audio clips of unequal lengths in one micro-batch"),
    PlantedBug("slice_empty_response_as_one", ("INV-EDGE-001",),
               helpers=(("no_padding_2_padding", H.slice_empty_response_as_one),),
               quiet="a zero-length response (an aborted rollout)"),
    PlantedBug("media_sliced_not_selected", ("INV-MB-008", "INV-MB-015"), microbatch=MM.media_sliced_not_selected,
               quiet="a vision-language mini-batch the balancing reorders"),
)}


class PlantedEngine(ImplEngine):
    """impl with one planted bug (impl's own known failures do not excuse it; the records the bug claims,
    :attr:`PlantedBug.known`, are its known failures)."""

    known_failures: Any = {}

    def __init__(self, bug: PlantedBug):
        self.bug = bug
        self.known_failures = bug.known
        self.name = f"planted:{bug.name}"
        self.engine_classes = {"lm": bug.lm or impl.LMHeadEngine, "value": bug.value or impl.ValueHeadEngine}
        self.packer = bug.packer() if bug.packer else None
        self.layouts = tuple(ShardLayout) if bug.packer else self.layouts

    def helper(self, name: str) -> Callable | None:
        return dict(self.bug.helpers).get(name) or super().helper(name)

    def microbatch_layer(self):
        layer = super().microbatch_layer()
        return self.bug.microbatch(layer) if self.bug.microbatch and layer is not None else layer

    def step_layer(self):
        layer = super().step_layer()
        return self.bug.step(layer) if self.bug.step and layer is not None else layer

    def config_space(self):
        return (*super().config_space(), *self.bug.config)

    def precision(self, key, case):
        return self.bug.precision(key, case) if self.bug.precision else super().precision(key, case)

    def make(self, head: str = "lm", **settings: Any) -> Any:
        if self.bug.companion is not None:  # the companion's switches configure the processor, not the engine
            for switch in self.bug.config:
                settings.pop(switch.name, None)
        return super().make(head, **settings)

    def logits_processor(self, case, sp_size=1, sp_rank=0):
        return self.bug.companion(case, sp_size, sp_rank) if self.bug.companion else None

    def companions(self):
        if self.bug.companion is None:
            return super().companions()
        return {"logits_processor": "own: the planted engine's chunked top-K processor (with its bug)"}


def planted_engine(name: str) -> PlantedEngine:
    if name not in PLANTED:
        raise ValueError(f"unknown planted bug {name!r}; known: {sorted(PLANTED)}")
    engine = PlantedEngine(PLANTED[name])
    engine.built_by = (planted_engine, (name,))  # a rank process builds it by name
    return engine
