"""verl's Megatron packing as an engine under test (``--engine verl-megatron``).

What Megatron prepares lives in ``verl.models.mcore.util``: ``preprocess_thd_engine`` /
``postprocess_thd_engine`` (THD packing, per-sequence TP x CP alignment, zig-zag or contiguous CP
split, FP8 and bucket alignment, ``need_roll`` labels) and ``preprocess_bshd_engine`` /
``postprocess_bshd_engine``; ``model_forward.gptmodel_forward_model_engine`` calls them around the
model. :class:`VerlMegatronPacker` calls those four functions, as they are, for every CP rank.

The seams, the ones a process group would fill: the module's ``mpu`` reference
(``megatron.core.parallel_state``: TP size, CP size and rank, CP group) is replaced by a fake for the
duration of each call, and ``torch.distributed.all_gather`` (CP > 1, in the postprocess) is answered
from the shards the packer produced for every rank. ``megatron-core`` itself installs CPU-only
(``pip install --no-deps megatron-core``); where it does not import, verl's module-level imports of it
are stubbed.

Megatron's engine methods ``prepare_model_inputs`` / ``prepare_model_outputs`` are pass-throughs:
the preparation runs inside ``gptmodel_forward_model_engine`` around the model call, with megatron's
vocab-parallel kernels (``tensor_parallel.vocab_parallel_cross_entropy``, a TP process group). So
this adapter offers :attr:`Feature.PACKING` (the packing invariants, every TP x CP) and :attr:`Feature.ENGINE`
on one rank: the engine object runs ``forward_step`` as a whole, TP = CP = 1 (spec/engines/megatron/engine.py).
On a vision-language micro-batch the packer also runs the engine's own ``forward_step`` up to the model call
(:meth:`VerlMegatronPacker.vlm_inputs`, spec/engines/megatron/media.py): INV-MEG-006 checks what it hands the model.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Iterator
from unittest import mock

import torch

from ...protocol.known import KnownFailure, When
from ...truth.megatron_packing import MtpTargets, PackSpec, RoutesHanded, ThdShard, case_bucket, thd_alignment
from ...protocol.engine import EngineUnderTest, Feature, ShardLayout
from ...protocol.profile import ROUTES_SWITCH, VISION, equivalents_on
from ..verl.microbatch_records import MICROBATCH_RECORDS
from .records import MEGATRON_ENGINE_RECORDS, VISION_RECORDS
from .routing import BSHD_REPLAY, ROUTING_SURFACE, ROUTING_UNREACHABLE, EngineReplay, VerlRouterReplay
from .media import MEGATRON_MM_SURFACE, MEGATRON_MM_UNREACHABLE, MegatronVisionForward
from ...cases.structure import DISTILLATION_KEYS
from .engine import (ENGINE_SURFACE, ENGINE_UNREACHABLE, MEGATRON_CONFIG_SPACE, MEGATRON_REFUSES, MTP_SWITCH,
                     MegatronEngineObject, MegatronModel, megatron_precision, megatron_processor, megatron_view)
from ..kit import inputs_seen_by_model
from ..kit.stubs import import_verl_module
from ..verl.microbatch_layer import verl_microbatch_layer
from ..verl.mutants import VERL_EQUIVALENT_MUTANTS
from ..verl.profile import VERL_LAYER, VERL_LAYER_OFF_PATH, VERL_LAYER_UNREACHABLE

__all__ = ["MegatronEngine", "VerlMegatronPacker", "fake_parallel_state"]

MODULE = "verl.models.mcore.util"
_FORWARD = "verl.models.mcore.model_forward"


def fake_parallel_state(spec: PackSpec, rank: int) -> SimpleNamespace:
    """What ``verl.models.mcore.util`` reads of ``megatron.core.parallel_state`` (dynamic CP: its groups of a
    micro-batch's CP size; the fixed CP group is then of size 1)."""
    fixed = 1 if spec.dynamic else spec.cp
    return SimpleNamespace(get_tensor_model_parallel_world_size=lambda: spec.tp,
                           get_context_parallel_world_size=lambda: fixed,
                           get_context_parallel_rank=lambda: 0 if spec.dynamic else rank,
                           get_context_parallel_group=lambda: f"cp-group({fixed})",
                           get_dynamic_data_context_parallel_groups=lambda group_size: _DynamicGroup(group_size, rank))


def _local_cp_size(spec: PackSpec) -> int | None:
    """What verl's pre/postprocess take as ``local_cp_size``: the micro-batch's own CP size under dynamic CP, else
    None (the fixed CP group's)."""
    return spec.cp if spec.dynamic else None


class _DynamicGroup(str):
    """A dynamic CP group of ``size`` ranks as the fake parallel state hands it: its name, and this rank in it."""

    def __new__(cls, size: int, rank: int) -> "_DynamicGroup":
        group = super().__new__(cls, f"dynamic-cp-group({size})")
        group.rank = rank
        return group


class VerlMegatronPacker:
    """verl's THD/BSHD engine pre/postprocess, one call per CP rank (see the module docstring)."""

    def __init__(self, util: Any):
        self.util = util
        self._vision: MegatronVisionForward | None = None  # transformer_impl imported at the first media batch
        self._routing: VerlRouterReplay | None = None  # router_replay_utils imported at the first routed batch

    @contextmanager
    def _rank(self, spec: PackSpec, rank: int, gathered: list[torch.Tensor] | None = None) -> Iterator[None]:
        def all_gather(output_list, tensor, group=None, async_op=False):
            # answered from every rank's own output (the caller puts its own tensor back at its rank)
            for i, part in enumerate(gathered or []):
                output_list[i].copy_(part)

        def get_rank(group=None):
            return group.rank  # a dynamic CP group's (the only group verl asks its rank of here)

        with mock.patch.object(self.util, "mpu", fake_parallel_state(spec, rank)), \
                mock.patch.object(torch.distributed, "all_gather", all_gather), \
                mock.patch.object(torch.distributed, "get_rank", get_rank):
            yield

    def pack_thd(self, x: torch.Tensor, spec: PackSpec, rank: int, *, need_roll: bool = False) -> ThdShard:
        with self._rank(spec, rank):
            rows, params, positions = self.util.preprocess_thd_engine(
                x, pre_process=True, need_roll=need_roll, use_fp8_padding=spec.fp8,
                local_cp_size=_local_cp_size(spec),
                pad_to_length_bucket=spec.bucket, cp_layout=spec.layout.value)
        return ThdShard(rows, positions, params.cu_seqlens_q_padded, params)

    def later_stage_thd(self, x: torch.Tensor, spec: PackSpec, rank: int) -> ThdShard:
        """A pipeline stage after the first: ``pre_process=False``."""
        with self._rank(spec, rank):
            rows, params, positions = self.util.preprocess_thd_engine(
                x, pre_process=False, use_fp8_padding=spec.fp8, local_cp_size=_local_cp_size(spec),
                pad_to_length_bucket=spec.bucket, cp_layout=spec.layout.value)
        return ThdShard(rows, positions, params.cu_seqlens_q_padded, params)

    def hand_on_thd(self, output: torch.Tensor, shard: ThdShard, x: torch.Tensor, spec: PackSpec,
                    rank: int) -> torch.Tensor:
        """A pipeline stage before the last: ``post_process=False``."""
        with self._rank(spec, rank):
            return self.util.postprocess_thd_engine(output, shard.state, x, x.shape[0], post_process=False,
                                                    local_cp_size=_local_cp_size(spec),
                                                    cp_layout=spec.layout.value)

    def hand_on_bshd(self, output: torch.Tensor, mask: torch.Tensor, spec: PackSpec, rank: int) -> torch.Tensor:
        with self._rank(spec, rank):
            return self.util.postprocess_bshd_engine(output, mask, post_process=False)

    def unpack_thd(self, shards: list[ThdShard], x: torch.Tensor, spec: PackSpec) -> torch.Tensor:
        outs = []
        gathered = [s.rows for s in shards]
        for rank, shard in enumerate(shards):  # every rank re-assembles; they must agree
            with self._rank(spec, rank, gathered):
                outs.append(self.util.postprocess_thd_engine(shard.rows, shard.state, x, x.shape[0], post_process=True,
                                                             local_cp_size=_local_cp_size(spec),
                                                             cp_layout=spec.layout.value))
        for rank, out in enumerate(outs[1:], 1):
            if not all(torch.equal(a, b) for a, b in zip(out.unbind(), outs[0].unbind())):
                raise AssertionError(f"CP rank {rank} re-assembles other values than rank 0 ({spec})")
        return outs[0]

    def pack_bshd(self, x: torch.Tensor, spec: PackSpec, rank: int, *, need_roll: bool = False):
        if spec.layout is not ShardLayout.ZIGZAG and spec.cp > 1:
            raise NotImplementedError("preprocess_bshd_engine splits CP zig-zag only")
        with self._rank(spec, rank):
            return self.util.preprocess_bshd_engine(x, pre_process=True, need_roll=need_roll, use_fp8_padding=spec.fp8)

    def unpack_bshd(self, shards, x: torch.Tensor, spec: PackSpec) -> torch.Tensor:
        rows = [s[0] for s in shards]
        masks = [s[1] for s in shards]
        out = None
        for rank, (local, mask, _pos) in enumerate(shards):
            gathered = iter((rows, masks))

            def all_gather(output_list, tensor, group=None, async_op=False, _it=gathered):
                for i, part in enumerate(next(_it)):
                    output_list[i].copy_(part)

            with mock.patch.object(self.util, "mpu", fake_parallel_state(spec, rank)), \
                    mock.patch.object(torch.distributed, "all_gather", all_gather):
                result = self.util.postprocess_bshd_engine(local, mask, post_process=True)
            if out is None:
                out = result
            elif not all(torch.equal(a, b) for a, b in zip(result.unbind(), out.unbind())):
                raise AssertionError(f"CP rank {rank} re-assembles other values than rank 0 ({spec})")
        return out

    def vlm_inputs(self, micro_batch: Any, spec: PackSpec, rank: int, *, packed: bool) -> dict[str, Any]:
        """What Megatron's engine hands a vision-language model (spec/engines/megatron/media.py)."""
        if self._vision is None:
            self._vision = MegatronVisionForward()
        return self._vision.handed(micro_batch, spec, rank, self._rank, packed=packed)

    def mtp_targets(self, x: torch.Tensor, response_mask: torch.Tensor, spec: PackSpec, rank: int, *, packed: bool,
                    factor: float | None = None, dense_mask: bool = False) -> MtpTargets:
        """What ``gptmodel_forward_model_engine(mtp_enable_train=True)`` hands an MTP model on ``rank``
        (model_forward.py:316-332 THD, 416-432 BSHD): the labels (``forward_step``'s: the ids) and the loss mask
        (``forward_step``'s: the response mask; ``dense_mask``: padded ``(B, R)`` beside its
        ``response_attention_mask``, as a padded micro-batch carries it) packed with ``need_roll``, THD the
        positions and the factor on ``packed_seq_params``."""
        forward = import_verl_module("verl-megatron", _FORWARD, ("megatron",))[1].module
        attention = None
        if dense_mask:
            lens = response_mask.offsets().diff()
            attention = torch.arange(int(lens.max())).unsqueeze(0) < lens.unsqueeze(1)
            dense = response_mask.values().new_zeros(attention.shape)
            dense[attention] = response_mask.values()
            response_mask = dense
        args = {"label": x, "loss_mask": response_mask, "response_attention_mask": attention}
        with self._rank(spec, rank):
            handed = inputs_seen_by_model(lambda model: forward.gptmodel_forward_model_engine(
                MegatronModel(model, spec), x, {}, logits_processor=None, logits_processor_args=args,
                data_format="thd" if packed else "bshd", mtp_enable_train=True, local_cp_size=_local_cp_size(spec),
                pad_to_length_bucket=spec.bucket if packed else None, cp_layout=spec.layout.value,
                mtp_loss_normalization_factor=factor))
        params = handed.get("packed_seq_params")
        return MtpTargets(handed.get("labels"), handed.get("loss_mask"),
                          handed.get("position_ids") if packed else None,
                          getattr(params, "_verl_mtp_loss_normalization_factor", None))

    def replayed_routes(self, micro_batch: Any, spec: PackSpec, rank: int, *, mode: str) -> RoutesHanded:
        """What ``forward_step`` hands ``rank``'s routers to replay (spec/engines/megatron/routing.py), the routers
        found in REPLAY_BACKWARD (a micro-batch after another's backward) and the model a virtual stage's chunk on
        every other setting."""
        turn = (spec.tp + spec.cp + rank) % 2 == 1
        return self._router_replay().replayed(micro_batch, spec, rank, self._rank, mode=mode, backward_first=turn,
                                      vp_stage=turn)

    def recorded_routes(self, micro_batch: Any, recorded: list[list[torch.Tensor]], spec: PackSpec) -> torch.Tensor:
        """``merge_router_topk_indices`` over every TP and CP rank (spec/engines/megatron/routing.py)."""
        return self._router_replay().recorded(micro_batch, recorded, spec, self._rank, _local_cp_size(spec))

    def _router_replay(self) -> VerlRouterReplay:
        if self._routing is None:  # router_replay_utils imported at the first routed batch
            self._routing = VerlRouterReplay()
        return self._routing


def _bucket_breaks_alignment(case: Any) -> bool:
    """Whether verl's bucket padding (the total rounded up to lcm(bucket, CP), FP8's total alignment included,
    all of it on the last sequence) leaves the last sequence off its per-sequence alignment for some TP, CP in
    {1, 2, 4} and either CP layout: the arithmetic of the bug, on the case the packing invariants run."""
    bucket = case_bucket(case)
    if not bucket:
        return False
    fp8 = case.seed // 3 % 4 == 1  # as spec/invariants/megatron.py draws it
    for tp, cp, layout in itertools.product((1, 2, 4), (1, 2, 4), ShardLayout):
        align, _ = thd_alignment(PackSpec(tp, cp, layout, fp8=fp8))
        lens = [-(-n // align) * align for n in case.seq_lens]
        total_alignment = math.lcm(bucket, cp, 128 * tp * cp * (2 if layout is ShardLayout.ZIGZAG and cp > 1 else 1)
                                   if fp8 else 1)
        last = lens[-1] + (-sum(lens)) % total_alignment
        if last % align:
            return True
    return False


UNALIGNED_BUCKET = When("a static bucket (the case's, or the one its seed picks) after which verl's padded last "
                        "sequence is no multiple of its TP x CP alignment for some TP, CP in {1, 2, 4}",
                        _bucket_breaks_alignment)


_U = "verl.models.mcore.util"
_CONTIGUOUS = ("contiguous CP needs megatron-core's PackedSeqParams.cp_partition_mode (DeepSeek-V4's CP attention), "
               "which no released megatron-core has: 0.16.1 here lacks it, and so does 0.19.2, the newest (checked "
               "2026-12-07); verl refuses cp_layout='contiguous' with CP > 1 without it: the adapter packs zig-zag "
               "only (layout_note)")
_NPU = "needs an Ascend NPU (npu_fusion_attention's attention-mask layout)"
_MIN_ROWS = ("needs another model family's configuration: verl 0.9.1 passes min_local_rows only for DeepSeek-V4's "
             "hybrid attention (experimental_attention_variant 'dsv4_hybrid': its csa_window_size, in "
             "model_forward_fused.py:279, router_replay_utils.py:338/473 and the dynamic-CP schedule); every other "
             "model packs with None")
_BACK_CHUNK = ("dead code for the contract's sequences (each holds its prompt, n_i = p_i + r_i >= 1, docs/contract.md): "
               "remain_len is always half_seqlen (each sequence is first padded to pad_target >= seqlen_padded_i, so "
               "remain_end is never cut), >= 1 as a non-empty sequence's seqlen_padded_i >= 2 x CP: a zig-zag rank's "
               "back chunk is never empty, also with the static bucket's padding on the last sequence")
#: branches of the surface no CPU run of the suite reaches (verl 0.9.1's lines), each with its reason
MEGATRON_UNREACHABLE: dict[str, str] = {
    **VERL_LAYER_UNREACHABLE,  # (its "*:raise" covers the packers' refusals: a cp_layout, a bucket <= 0)
    f"{_U}:370->371": _CONTIGUOUS, f"{_U}:539->544": _CONTIGUOUS, f"{_U}:436": _CONTIGUOUS, f"{_U}:441": _CONTIGUOUS,
    f"{_U}:449": _CONTIGUOUS, f"{_U}:614->615": _CONTIGUOUS, f"{_U}:616": _CONTIGUOUS,
    f"{_U}:396->397": _MIN_ROWS, f"{_U}:398": _MIN_ROWS,
    f"{_U}:503->516": _BACK_CHUNK, f"{_U}:520->434": _BACK_CHUNK,
    f"{_U}:768->770": _NPU, f"{_U}:786->787": _NPU,
}


#: what the packing measures of verl (spec.run.engine_coverage): its THD/BSHD pre/postprocess, the vision path and
#: the micro-batch layer
MEGATRON_SURFACE = (*(f"{_U}:{f}" for f in (
    "preprocess_thd_engine", "postprocess_thd_engine", "preprocess_bshd_engine", "postprocess_bshd_engine",
    "_compute_fp8_thd_align_size")), *MEGATRON_MM_SURFACE, *ENGINE_SURFACE, *ROUTING_SURFACE, *VERL_LAYER)
_ARANGE = "torch.arange of Python ints is int64 already: dtype=torch.long changes nothing"
_ONE_D = "a 1-D tensor (the per-sequence lengths): its other dim, -1, is dim 0"
_MASK_VALUES = ("the mask is built int64 instead of bool with the same 0/1 values: the contract states a 2-D mask's "
                "values (0/1 in an integer or bool dtype, as INV-MASK-002), not its dtype")
_BOOL_MASK = "the masks preprocess_bshd_engine builds (and the gather returns) are bool already"
_ALIGN_ONE = "with an alignment of 1 the pad (1 - n % 1) % 1 is 0: the width is the same"
#: survivors of ``spec mutate --engine verl-megatron`` that no input tells from verl's code, each with why (by id);
#: and verl's own declarations on the functions the surfaces share (the micro-batch layer's)
MEGATRON_EQUIVALENT_MUTANTS: dict[str, str] = {
    **equivalents_on(VERL_EQUIVALENT_MUTANTS, MEGATRON_SURFACE),
    f"{_U}:preprocess_thd_engine:384 dim: dim -> other dim": _ONE_D,
    f"{_U}:preprocess_thd_engine:386 dim: dim -> other dim": _ONE_D,
    f"{_U}:preprocess_thd_engine:467 dtype: dtype= dropped": _ARANGE,
    f"{_U}:preprocess_thd_engine:513 dtype: dtype= dropped": _ARANGE,
    f"{_U}:preprocess_bshd_engine:756 dtype: dtype= dropped": _ARANGE,
    f"{_U}:preprocess_bshd_engine:761 dtype: dtype= dropped": _ARANGE,
    f"{_U}:preprocess_thd_engine:496 dtype: dtype= dropped": _ARANGE,
    f"{_U}:preprocess_thd_engine:483 dtype: dtype= dropped":
        "the zig-zag pad's zeros come out float32: torch.cat then promotes the sequence to float32 (int ids are exact "
        "below 2**24, every vocabulary's; a float64 one stays float64) and input_ids_rmpad, of the input's dtype, "
        "casts the rows back where they are written: the same values",
    f"{_U}:preprocess_bshd_engine:707 compare: Gt -> GtE": "with one CP rank max_seqlen // 1 is max_seqlen",
    f"{_U}:build_vlm_attn_mask_bshd:898 dtype: dtype= dropped": _MASK_VALUES,
    f"{_U}:preprocess_thd_engine:503 compare: Gt -> GtE": "remain_len is always half_seqlen >= 1 (the back chunk's "
                                                          "reason, 503->516 above): > 0 and >= 0 agree",
    f"{_U}:preprocess_thd_engine:372 compare: Gt -> GtE":
        "zig-zag's factor 2 also with one CP rank: each sequence padded to a multiple of 2 x TP instead of TP, still "
        "a multiple of the alignment the packing asks (INV-MEG-002: TP x CP, x2 zig-zag with CP > 1), with more "
        "padding rows, which the re-assembly drops: no output changes",
    f"{_U}:postprocess_bshd_engine:800 compare: Gt -> GtE": "with one CP rank the gather over its group returns the "
                                                           "rank's own output (and mask): the same rows",
    f"{_U}:preprocess_thd_engine:511 compare: Gt -> GtE": "with valid_pos_len == 0 the arange is empty: it writes no "
                                                          "position",
    f"{_U}:preprocess_thd_engine:519 arith: Add -> Sub #2": "need_roll's positions are dropped by every caller "
                                                           "(model_forward.py:329 and 430 keep [0], the rolled rows)",
    f"{_U}:preprocess_thd_engine:522 arith: Add -> Sub #2":
        "the wrap label of a sequence's last padded row (d[0], CP rank 0, whose back chunk ends the sequence) moves "
        "to the row before the sequence's first on the rank: the previous sequence's last padded row (for the first "
        "sequence, index -1: the last sequence's), whose own wrap label it overwrites; both follow a sequence's last "
        "row, which has no next token (the contract's 'then anything'); no label of a token inside a sequence moves",
    f"{_U}:postprocess_bshd_engine:805 dtype: dtype= dropped": "torch.empty_like keeps the mask's dtype: "
                                                              "dtype=attention_mask.dtype changes nothing",
    f"{_U}:postprocess_bshd_engine:815 cast: .bool() removed": _BOOL_MASK,
    f"{_U}:postprocess_bshd_engine:829 cast: .bool() removed": _BOOL_MASK,
    f"{_U}:build_vlm_attn_mask_thd:858 compare: Gt -> GtE": _ALIGN_ONE,
    f"{_U}:build_vlm_attn_mask_bshd:889 compare: Gt -> GtE": _ALIGN_ONE,
    f"{_U}:build_vlm_attn_mask_thd:865 dtype: dtype= dropped": _MASK_VALUES,
}


class MegatronEngine(EngineUnderTest):
    """verl's Megatron packing (``Feature.PACKING``); no engine object (see the module docstring)."""

    name = "verl-megatron"
    #: verl's Megatron packing (THD and BSHD pre/postprocess) and its micro-batch layer
    profile = replace(EngineUnderTest.profile, surface=MEGATRON_SURFACE,
                      unreachable={**MEGATRON_UNREACHABLE, **MEGATRON_MM_UNREACHABLE, **ENGINE_UNREACHABLE,
                                   **ROUTING_UNREACHABLE},
                      off_path=VERL_LAYER_OFF_PATH,
                      media=VISION, equivalent_mutants=MEGATRON_EQUIVALENT_MUTANTS, refuses=MEGATRON_REFUSES,
                      config_space=MEGATRON_CONFIG_SPACE, routes_modes=("packed",), routes_note=BSHD_REPLAY)
    layouts = (ShardLayout.ZIGZAG, ShardLayout.CONTIGUOUS)
    layout_note = ""
    #: failures documented in spec/engines/megatron/README.md: one bug, seen by five properties
    KNOWN: tuple[KnownFailure, ...] = tuple(
        KnownFailure(inv, "preprocess_thd_engine pads the total to lcm(pad_to_length_bucket, CP) and gives it to the "
                     "last sequence, which then is no multiple of 2*CP (zig-zag) or TP: the CP split drops rows and "
                     f"postprocess_thd_engine raises; engine bug ({what})", raises=AssertionError,
                     matches=r"^AssertionError: \[TP=\d+ CP=\d+ \w+(, fp8)?, bucket=\d+(, dynamic CP)?\] "
                             r"(the packer raised RuntimeError: The expanded size of the tensor|padded lengths )",
                     when=UNALIGNED_BUCKET)
        for inv, what in (("INV-MEG-001", "round trip"), ("INV-MEG-002", "alignment"),
                          ("INV-MEG-003", "positions"), ("INV-MEG-004", "labels"), ("INV-MEG-008", "MTP targets")))

    def __init__(self) -> None:
        self.version, self.stubs = import_verl_module(self.name, MODULE, ("megatron",))
        self.packer = VerlMegatronPacker(self.stubs.module)
        # contiguous CP needs megatron-core's PackedSeqParams.cp_partition_mode (verl raises without it)
        if not getattr(self.stubs.module, "_PACKED_SEQ_PARAMS_HAS_CP_PARTITION_MODE", True):
            self.layouts = (ShardLayout.ZIGZAG,)
            self.layout_note = ("contiguous CP not run: this megatron-core's PackedSeqParams has no "
                                "cp_partition_mode, and verl refuses cp_layout='contiguous' with CP > 1 without it")
        self.known_failures = (*self.KNOWN, *VISION_RECORDS, *MEGATRON_ENGINE_RECORDS, *MICROBATCH_RECORDS.get("*", ()),
                               *MICROBATCH_RECORDS.get(self.version, ()))

    def microbatch_layer(self):
        """verl's own micro-batch functions: Megatron's forward_backward_batch calls prepare_micro_batches (with
        num_batches_divided_by for virtual pipeline stages) and postprocess_batch_func."""
        if not hasattr(self, "_microbatch"):
            self._microbatch = verl_microbatch_layer()
        return self._microbatch

    #: why the engine object (one rank, TP = CP = 1: spec/engines/megatron/engine.py) lacks a feature
    ENGINE_LACKS = {
        Feature.SP: "context parallelism splits the packed row across CP ranks: the packing invariants (INV-MEG-*) "
                    "check that split; the engine object runs one rank (TP = CP = 1)",
        Feature.FUSED: "fused kernels (get_mcore_forward_fused_model_engine_fn) patch megatron's GPTModel output layer "
                       "with verl's fused linear cross-entropy kernel: a real GPTModel, not run",
        Feature.TEMPERATURE_HANDOFF: "forward_step reads the micro-batch's temperatures itself (the logits processor "
                                     "is bound to the micro-batch)",
    }

    def lacks(self, feature: str | Feature) -> str | None:
        feature = Feature.parse(feature)
        if feature is Feature.PACKING or feature is Feature.ENGINE:
            if self.stubs.stubbed:
                return ("megatron-core does not import here (stubbed: " + ", ".join(self.stubs.stubbed)
                        + "); PackedSeqParams is megatron's record, install megatron-core")
            return None
        if feature in self.ENGINE_LACKS:
            return f"verl-megatron {self.version}: {self.ENGINE_LACKS[feature]}"
        return super().lacks(feature)

    def make(self, head: str = "lm", **settings: Any) -> MegatronEngineObject:
        if head not in ("lm", "value"):
            raise ValueError(f"unknown head {head!r} (lm or value)")
        if int(settings.pop("sp_size", 1) or 1) > 1:
            raise NotImplementedError(self.lacks(Feature.SP))
        settings.pop("sp_rank", None), settings.pop("all_gather", None)
        settings.pop("pass_cu_seqlens", None)  # Megatron hands its packed boundaries always
        chunk, bucket = settings.pop("entropy_chunk_size", None), settings.pop("pad_to_length", None)
        mtp = bool(settings.pop(MTP_SWITCH, False))
        routes = settings.pop(ROUTES_SWITCH, None)
        # a critic never replays; a BSHD micro-batch's replay is F28's (routes_note), not run by the engine object
        replay = EngineReplay(routes) if routes is not None and head == "lm" else None
        for switch in self.profile.config_space:  # drawn switches: read through their settings or the processor
            settings.pop(switch.name, None)
        if settings:
            raise TypeError(f"unknown engine settings for verl-megatron: {sorted(settings)}")
        return MegatronEngineObject(self.packer._rank, head=head, chunk=chunk, bucket=bucket, mtp=mtp, replay=replay)

    view_inputs = staticmethod(megatron_view)
    precision = staticmethod(megatron_precision)

    def logits_processor(self, case: Any, sp_size: int = 1, sp_rank: int = 0) -> Any:
        return megatron_processor(case)  # verl's own (spec/engines/megatron/engine.py)

    def processor_keys(self, case: Any) -> tuple[str, ...]:
        return DISTILLATION_KEYS  # compute_forward_kl_topk returns all five, whatever the case asks

    def companions(self) -> dict[str, str]:
        return {"logits_processor": "own: verl.trainer.distillation.losses.distillation_ppo_loss (megatron "
                                    "compute_forward_kl_topk, vocab-parallel on one rank)"}

    def __repr__(self) -> str:
        return f"<engine verl-megatron {self.version}>"
