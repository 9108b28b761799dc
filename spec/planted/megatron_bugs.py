"""Planted packing bugs: the reference packer (spec/truth/megatron_packing.py) with one plausible mistake."""

from __future__ import annotations

import torch

from ..truth.media_checks import samples_media, stack_entries
from ..truth.megatron_packing import PackSpec, ReferencePacker, full_loss_mask, nested_from
from ..protocol.engine import ShardLayout


class ZigzagHalvesSwapped(ReferencePacker):
    """Zig-zag re-assembly puts each rank's two chunks back in swapped places (front chunk at the back)."""

    def unpack_thd(self, shards, x, spec):
        if spec.cp == 1 or spec.layout is not ShardLayout.ZIGZAG:
            return super().unpack_thd(shards, x, spec)
        swapped = []
        for shard in shards:
            rows = shard.rows[0]
            parts, start = [], 0
            for n in shard.cu_seqlens_padded.diff().tolist():
                half = n // (2 * spec.cp)
                parts += [rows[start + half:start + 2 * half], rows[start:start + half]]
                start += 2 * half
            swapped.append(type(shard)(torch.cat(parts).unsqueeze(0), shard.positions, shard.cu_seqlens_padded))
        return super().unpack_thd(swapped, x, spec)

    def unpack_bshd(self, shards, x, spec):
        if spec.cp == 1:
            return super().unpack_bshd(shards, x, spec)
        half = shards[0][0].shape[1] // 2
        return super().unpack_bshd([(torch.cat([r[:, half:], r[:, :half]], 1), m, p) for r, m, p in shards], x, spec)


class AlignIgnoresTensorParallel(ReferencePacker):
    """Per-sequence padding aligned to CP only (TP forgotten): sequence-parallel scatter gets odd shards."""

    def _padded_lengths(self, lens, spec: PackSpec):
        return super()._padded_lengths(lens, PackSpec(1, spec.cp, spec.layout, spec.fp8, spec.bucket))


class RollLocalShard(ReferencePacker):
    """need_roll rolls each rank's own shard: at a shard (or zig-zag chunk) edge the label is the
    shard's first token, not the sequence's next one."""

    def pack_thd(self, x, spec, rank, *, need_roll=False):
        shard = super().pack_thd(x, spec, rank)
        if need_roll:
            shard.rows = torch.roll(shard.rows, -1, dims=1)
        return shard


class PositionsContinue(ReferencePacker):
    """Positions count through the packed row instead of restarting at each sequence."""

    def _global(self, x, padded, need_roll):
        rows, _ = super()._global(x, padded, need_roll)
        return rows, torch.arange(rows.shape[0])


class UnpackFromUnpaddedOffsets(ReferencePacker):
    """THD re-assembly reads sequence i at the unpadded offset cu_seqlens[i] of the padded row."""

    def unpack_thd(self, shards, x, spec):
        padded = shards[0].cu_seqlens_padded.diff().tolist()
        rows = torch.zeros(sum(padded), *shards[0].rows.shape[2:], dtype=shards[0].rows.dtype)
        for rank, shard in enumerate(shards):
            rows[self._rank_rows(padded, spec, rank)] = shard.rows[0]
        offsets = x.offsets().tolist()
        return nested_from([rows[s:e] for s, e in zip(offsets[:-1], offsets[1:])])


class VisionPackedAtUnpaddedOffsets(ReferencePacker):
    """A vision-language model handed the boundaries of the unpadded sequences (``cu_seqlens``) for packing its
    combined embeddings, the labels packed at the TP x CP-padded ones: after the first sequence's padding every
    token (its image features with it) is scored against another position's label."""

    def vlm_inputs(self, micro_batch, spec, rank, *, packed):
        handed = super().vlm_inputs(micro_batch, spec, rank, packed=packed)
        if packed:
            handed["cu_seqlens_padded"] = micro_batch["input_ids"].offsets().to(torch.int32)
        return handed


class VisionFeaturesLongestFirst(ReferencePacker):
    """The samples' media concatenated longest sample first (as a packer that sorts its sequences by length for
    balance), the rows kept in sample order: the model places one sample's image features at another's image
    tokens. Shows when two samples with media are out of length order."""

    def vlm_inputs(self, micro_batch, spec, rank, *, packed):
        handed = super().vlm_inputs(micro_batch, spec, rank, packed=packed)
        lens = micro_batch["input_ids"].offsets().diff().tolist()
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        entries = stack_entries(micro_batch.get("multi_modal_inputs"))
        return {**handed, **samples_media([entries[i] for i in order])}


class LaterStageUnpaddedBoundaries(ReferencePacker):
    """A pipeline stage after the first packs its boundaries from the unpadded lengths (the TP x CP alignment
    forgotten where no input_ids are packed): its attention segments drift from the first stage's."""

    def later_stage_thd(self, x, spec, rank):
        shard = super().later_stage_thd(x, spec, rank)
        cu = torch.tensor([0, *x.offsets().diff().tolist()]).cumsum(0).to(shard.cu_seqlens_padded.dtype)
        return type(shard)(shard.rows, None, cu)


class MtpLossMaskUnrolled(ReferencePacker):
    """The MTP loss mask packed aligned to the ids but not rolled with the labels: each position's mask is its own
    token's, so the first response token's label is never counted and a sequence's last token (whose label wraps to
    its first) is."""

    def mtp_targets(self, x, response_mask, spec, rank, *, packed, factor=None, dense_mask=False):
        handed = super().mtp_targets(x, response_mask, spec, rank, packed=packed, factor=factor, dense_mask=dense_mask)
        mask = full_loss_mask(response_mask, x.offsets().diff().tolist())
        handed.loss_mask = self.pack_thd(mask, spec, rank).rows if packed else self.pack_bshd(mask, spec, rank)[0]
        return handed


class RoutesPackedUnaligned(ReferencePacker):
    """Router replay packs the routes back to back, without the ids' per-sequence TP x CP alignment (the total padded
    at the end): with any alignment padding every route after the first sequence's lands on another token's row."""

    def replayed_routes(self, micro_batch, spec, rank, *, mode):
        handed = super().replayed_routes(micro_batch, spec, rank, mode=mode)
        routes, ids = micro_batch["routed_experts"], micro_batch["input_ids"]
        lens = ids.offsets().diff().tolist()
        values = torch.cat([torch.cat([r, r.new_zeros(n - r.shape[0], *r.shape[1:])])
                            for r, n in zip(routes.unbind(), lens)])
        total = sum(self._padded_lengths(lens, spec))
        row = torch.cat([values, values.new_zeros(total - values.shape[0], *values.shape[1:])])
        local = row[self._rank_rows(self._padded_lengths([total], spec), spec, rank)]
        handed.routes = list(local.chunk(spec.tp))
        return handed


class ReplayMaskResponseOnly(ReferencePacker):
    """R3's replay mask marks only the response's rows (built from the response mask's positions): the prompt's rows
    route natively, though every response token's log-prob attends to them."""

    def replayed_routes(self, micro_batch, spec, rank, *, mode):
        handed = super().replayed_routes(micro_batch, spec, rank, mode=mode)
        if mode != "R3":
            return handed
        lens = micro_batch["input_ids"].offsets().diff().tolist()
        responses = micro_batch["response_mask"].offsets().diff().tolist()
        replay = nested_from([torch.arange(n) >= n - r for n, r in zip(lens, responses)])
        handed.masks = list(self.pack_thd(replay, spec, rank).rows[0].chunk(spec.tp))
        return handed


class RecordTpPartsReversed(ReferencePacker):
    """R2's record gathers the TP ranks' recorded routes in reverse rank order: with TP > 1 each rank's rows take
    another rank's routes."""

    def recorded_routes(self, micro_batch, recorded, spec):
        return super().recorded_routes(micro_batch, [parts[::-1] for parts in recorded], spec)
