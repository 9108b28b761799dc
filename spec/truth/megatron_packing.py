"""Megatron-style packing: the calling convention the packing invariants use, and a reference packer.

A *packer* turns a jagged batch ``x`` (nested ``(B, j, *trailing)``) into per-rank shards and back:

* THD: every sequence padded to the TP x CP alignment (x2 for the zig-zag layout when CP > 1; FP8:
  per sequence ``lcm(16, align)``, the total a multiple of ``128 * align``; a static bucket: the
  total a multiple of ``lcm(bucket, align)``: the last sequence takes that padding and must stay
  aligned for the CP split and the TP scatter), one packed row; CP rank ``r`` holds either the r-th
  contiguous ``1/CP`` of that row, or, zig-zag, chunks ``r`` and ``2CP-1-r`` of every sequence.
  Dynamic CP (``PackSpec.dynamic``: a micro-batch's own CP size over a group of that size) splits the same way.
* BSHD: a dense ``(B, S, *trailing)`` batch, ``S`` aligned likewise (FP8: ``B*S`` a multiple of
  ``128 * TP * CP``), zig-zag across CP ranks, with a per-rank validity mask.

Under pipeline parallelism the first stage packs as above; a stage after it gets its input from the stage before
(hidden states already packed), so it is handed ``x`` as it is with no positions, and the first stage's boundaries
(``cu_seqlens_padded``: every stage attends within the same sequences); a stage before the last hands its output on
to the next as it is (the last re-assembles).

``need_roll`` packs the labels instead: at each valid token the next token of the *same* sequence.
Unpacking gathers every rank's shard and returns the valid tokens, nested like ``x``.

A model with multi-token prediction layers (MTP: DeepSeek-V3, MiMo) computes its MTP loss inside the model, so it is
handed its targets packed like the ids (``mtp_targets``): the labels (``need_roll``: the next token of the same
sequence), the loss mask aligned to the ids (the prompt's zeros, then the response mask) and rolled the same way (so
the last token of each sequence, whose next token is its own first, a prompt token, is never a loss position, and
padding never is), THD the rotary positions, and the loss normalization factor the step hands on (THD: on the
boundaries' ``packed_seq_params``).

A mixture-of-experts model can replay its routing (router replay): each router is handed a route (the ``top-k``
experts of each of its layers) for every token row it holds, and replays it instead of routing. A rank's routers hold
the rows of that rank's THD packing of the ids, split over the TP ranks in order (sequence parallelism: TP rank ``t``
holds the ``t``-th ``1/TP`` of the rank's row), so a route must be packed exactly like the ids. R2 replays in training
the routes recorded in the step's log-prob forward (every token's, gathered back to the tokens from every rank's
routers: ``recorded_routes``); R3 replays the routes the rollout recorded (``routed_experts``: a route for every token
but possibly a sequence's last, which no forward produced): the rows that can change a response token's log-prob (a
generating sequence's every row but its last) replay, a mask saying which (``replayed_routes``).

A vision-language model packs for itself (its image features must first reach its image tokens): it is handed
the micro-batch's ids in rows, one sample a row from column 0, the mask marking each sample's tokens, the samples'
media (features and grids concatenated in sample order) and, THD, the padded boundaries its labels are packed
with; it embeds, places the features, packs its combined embeddings with those boundaries. ``vlm_inputs`` returns
those by these names (``cu_seqlens_padded``: the boundaries, THD only).

:class:`ReferencePacker` implements this from the statement above (an index map from each rank's
rows to the global padded row); the planted packing bugs subclass it. verl's own packer is adapted
in :mod:`spec.engines.megatron.adapter`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..protocol.engine import ShardLayout, read_flags
from .media_checks import samples_media, stack_entries

__all__ = ["PackSpec", "ThdShard", "MtpTargets", "RoutesHanded", "Packer", "ReferencePacker", "thd_alignment",
           "nested_from", "case_bucket", "full_loss_mask"]


@dataclass(frozen=True)
class PackSpec:
    tp: int = 1
    cp: int = 1
    layout: ShardLayout = ShardLayout.ZIGZAG
    fp8: bool = False
    bucket: int | None = None
    #: CP as dynamic context parallelism (a micro-batch's own CP size, ``local_cp_size``, over a group of that size
    #: taken per micro-batch): the same split, the group and rank another way
    dynamic: bool = False

    def __str__(self) -> str:
        extra = ((", fp8" if self.fp8 else "") + (f", bucket={self.bucket}" if self.bucket else "")
                 + (", dynamic CP" if self.dynamic else ""))
        return f"TP={self.tp} CP={self.cp} {self.layout.value}{extra}"


@dataclass
class ThdShard:
    """One CP rank's packed rows: ``rows`` ``(1, n_local, *trailing)``, ``positions`` ``(1, n_local)`` or
    None, ``cu_seqlens_padded`` ``(B+1,)`` of the global padded row; ``state``: what the packer needs back."""

    rows: torch.Tensor
    positions: torch.Tensor | None
    cu_seqlens_padded: torch.Tensor
    state: Any = None


@dataclass
class MtpTargets:
    """What an MTP model is handed on one rank (the module docstring), in that rank's layout (THD ``(1, n_local)``,
    BSHD ``(B, S_local)``): its ``labels`` and ``loss_mask``, THD its ``positions``, and the loss normalization
    ``factor`` (THD: on ``packed_seq_params``; None where none is handed)."""

    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    positions: torch.Tensor | None = None
    factor: float | None = None


@dataclass
class RoutesHanded:
    """What one CP rank's routers are handed to replay (the module docstring): per TP rank, in order, the routes of
    its rows (``(n_local / TP, layers, top_k)``) and its replay mask (``(n_local / TP,)``, True where the row replays
    its route; None: every row replays)."""

    routes: list[torch.Tensor]
    masks: list[torch.Tensor | None]


@runtime_checkable
class Packer(Protocol):
    def pack_thd(self, x: torch.Tensor, spec: PackSpec, rank: int, *, need_roll: bool = False) -> ThdShard: ...

    def unpack_thd(self, shards: list[ThdShard], x: torch.Tensor, spec: PackSpec) -> torch.Tensor: ...

    def pack_bshd(self, x: torch.Tensor, spec: PackSpec, rank: int, *,
                  need_roll: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def unpack_bshd(self, shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], x: torch.Tensor,
                    spec: PackSpec) -> torch.Tensor: ...

    def vlm_inputs(self, micro_batch: Any, spec: PackSpec, rank: int, *, packed: bool) -> dict[str, Any]: ...

    def later_stage_thd(self, x: torch.Tensor, spec: PackSpec, rank: int) -> ThdShard: ...

    def hand_on_thd(self, output: torch.Tensor, shard: ThdShard, x: torch.Tensor, spec: PackSpec,
                    rank: int) -> torch.Tensor: ...

    def hand_on_bshd(self, output: torch.Tensor, mask: torch.Tensor, spec: PackSpec, rank: int) -> torch.Tensor: ...

    def mtp_targets(self, x: torch.Tensor, response_mask: torch.Tensor, spec: PackSpec, rank: int, *, packed: bool,
                    factor: float | None = None, dense_mask: bool = False) -> MtpTargets: ...

    def replayed_routes(self, micro_batch: Any, spec: PackSpec, rank: int, *, mode: str) -> RoutesHanded: ...

    def recorded_routes(self, micro_batch: Any, recorded: list[list[torch.Tensor]], spec: PackSpec) -> torch.Tensor: ...


def full_loss_mask(response_mask: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The response mask (nested ``(B, j_r)``) aligned to sequences of ``lens`` tokens: each sequence's prompt
    zeros, then its response mask (nested ``(B, j)``)."""
    return nested_from([torch.cat([r.new_zeros(n - r.shape[0]), r]) for r, n in zip(response_mask.unbind(), lens)])


def case_bucket(case: Any) -> int | None:
    """The static bucket the packing invariants run a case with: the case's own, else one chosen by its seed
    (the strategies draw buckets only for a small share of packed cases; the packing must hold with and
    without one)."""
    return case.pad_to_length or (None, 4, 7, 8, 16)[case.seed // 12 % 5]


def thd_alignment(spec: PackSpec) -> tuple[int, int]:
    """(per-sequence alignment, alignment of the total) of a THD packed row."""
    base = spec.tp * spec.cp * (2 if spec.layout is ShardLayout.ZIGZAG and spec.cp > 1 else 1)
    align, total = base, spec.cp
    if spec.fp8:
        align, total = math.lcm(16, base), math.lcm(total, 128 * base)
    if spec.bucket:  # the last sequence takes the bucket's padding, so it must keep its own alignment
        total = math.lcm(total, spec.bucket, align)
    return align, total


def nested_from(rows: list[torch.Tensor]) -> torch.Tensor:
    values = torch.cat(rows)
    offsets = torch.tensor([0] + [r.shape[0] for r in rows]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


class ReferencePacker:
    """The statement in the module docstring, as an index map (rank rows -> global padded row)."""

    def _padded_lengths(self, lens: list[int], spec: PackSpec) -> list[int]:
        align, total = thd_alignment(spec)
        padded = [-(-n // align) * align for n in lens]
        padded[-1] += -sum(padded) % total
        return padded

    def _rank_rows(self, padded: list[int], spec: PackSpec, rank: int) -> torch.Tensor:
        starts = [0, *torch.tensor(padded).cumsum(0).tolist()]
        if spec.cp == 1 or spec.layout is ShardLayout.CONTIGUOUS:
            width = starts[-1] // spec.cp
            return torch.arange(rank * width, (rank + 1) * width)
        parts = []
        for start, n in zip(starts, padded):
            chunk = n // (2 * spec.cp)
            for c in (rank, 2 * spec.cp - 1 - rank):
                parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        return torch.cat(parts)

    def _global(self, x: torch.Tensor, padded: list[int], need_roll: bool) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = list(x.unbind())
        rows = torch.zeros(sum(padded), *seqs[0].shape[1:], dtype=x.dtype)
        pos = torch.zeros(sum(padded), dtype=torch.long)
        start = 0
        for seq, n in zip(seqs, padded):
            src = torch.roll(seq, -1, dims=0) if need_roll else seq
            rows[start:start + seq.shape[0]] = src
            pos[start:start + seq.shape[0]] = torch.arange(seq.shape[0])
            start += n
        return rows, pos

    def pack_thd(self, x: torch.Tensor, spec: PackSpec, rank: int, *, need_roll: bool = False) -> ThdShard:
        lens = x.offsets().diff().tolist()
        padded = self._padded_lengths(lens, spec)
        rows, pos = self._global(x, padded, need_roll)
        index = self._rank_rows(padded, spec, rank)
        cu = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
        return ThdShard(rows[index].unsqueeze(0), pos[index].unsqueeze(0), cu)

    def later_stage_thd(self, x: torch.Tensor, spec: PackSpec, rank: int) -> ThdShard:
        """What a pipeline stage after the first is handed (the module docstring): ``x`` as it is, no positions,
        the first stage's boundaries."""
        return ThdShard(x, None, self.pack_thd(x, spec, rank).cu_seqlens_padded)

    def hand_on_thd(self, output: torch.Tensor, shard: ThdShard, x: torch.Tensor, spec: PackSpec,
                    rank: int) -> torch.Tensor:
        """What a pipeline stage before the last does with its output: hands it on as it is."""
        return output

    def hand_on_bshd(self, output: torch.Tensor, mask: torch.Tensor, spec: PackSpec, rank: int) -> torch.Tensor:
        return output

    def unpack_thd(self, shards: list[ThdShard], x: torch.Tensor, spec: PackSpec) -> torch.Tensor:
        padded = shards[0].cu_seqlens_padded.diff().tolist()
        rows = torch.zeros(sum(padded), *shards[0].rows.shape[2:], dtype=shards[0].rows.dtype)
        for rank, shard in enumerate(shards):
            rows[self._rank_rows(padded, spec, rank)] = shard.rows[0]
        starts = [0, *torch.tensor(padded).cumsum(0).tolist()]
        lens = x.offsets().diff().tolist()
        return nested_from([rows[s:s + n] for s, n in zip(starts, lens)])

    def _bshd_width(self, lens: list[int], spec: PackSpec) -> int:
        align = spec.tp * spec.cp * 2 if spec.cp > 1 else spec.tp
        if spec.fp8:
            total = 128 * spec.tp * spec.cp
            align = math.lcm(align, total // math.gcd(len(lens), total))
        return -(-max(lens) // align) * align

    def _bshd_cols(self, width: int, spec: PackSpec, rank: int) -> torch.Tensor:
        if spec.cp == 1:
            return torch.arange(width)
        chunk = width // (2 * spec.cp)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (rank, 2 * spec.cp - 1 - rank)])

    def pack_bshd(self, x: torch.Tensor, spec: PackSpec, rank: int, *,
                  need_roll: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lens = x.offsets().diff().tolist()
        width = self._bshd_width(lens, spec)
        seqs = list(x.unbind())
        dense = torch.zeros(len(seqs), width, *seqs[0].shape[1:], dtype=x.dtype)
        for i, seq in enumerate(seqs):
            dense[i, :seq.shape[0]] = torch.roll(seq, -1, dims=0) if need_roll else seq
        cols = self._bshd_cols(width, spec, rank)
        mask = cols.unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        return dense[:, cols], mask, cols.unsqueeze(0).expand(len(seqs), -1)

    def unpack_bshd(self, shards: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], x: torch.Tensor,
                    spec: PackSpec) -> torch.Tensor:
        local = shards[0][0]
        width = local.shape[1] * spec.cp
        dense = torch.zeros(local.shape[0], width, *local.shape[2:], dtype=local.dtype)
        for rank, (rows, _mask, _pos) in enumerate(shards):
            dense[:, self._bshd_cols(width, spec, rank)] = rows
        lens = x.offsets().diff().tolist()
        return nested_from([dense[i, :n] for i, n in enumerate(lens)])

    def vlm_inputs(self, micro_batch: Any, spec: PackSpec, rank: int, *, packed: bool) -> dict[str, Any]:
        """What a vision-language model is handed for ``micro_batch`` (the module docstring): the rows as wide as
        the BSHD labels' (:meth:`pack_bshd`), the pad id after each sample's tokens."""
        ids = micro_batch["input_ids"]
        lens = ids.offsets().diff().tolist()
        width = self._bshd_width(lens, spec)
        rows = ids.values().new_full((len(lens), width), read_flags(micro_batch)["pad_token_id"])
        mask = torch.arange(width) < torch.tensor(lens).unsqueeze(1)
        rows[mask] = ids.values()
        media = samples_media(stack_entries(micro_batch.get("multi_modal_inputs")))
        handed = {"input_ids": rows, "attention_mask": mask, **media}
        if packed:
            handed["cu_seqlens_padded"] = self.pack_thd(ids, spec, rank).cu_seqlens_padded
        return handed

    def mtp_targets(self, x: torch.Tensor, response_mask: torch.Tensor, spec: PackSpec, rank: int, *, packed: bool,
                    factor: float | None = None, dense_mask: bool = False) -> MtpTargets:
        """What an MTP model is handed on ``rank`` (the module docstring), THD (``packed``) or BSHD; ``dense_mask``
        (the response mask handed padded beside its attention mask) does not change it."""
        mask = full_loss_mask(response_mask, x.offsets().diff().tolist())
        if not packed:
            return MtpTargets(self.pack_bshd(x, spec, rank, need_roll=True)[0],
                              self.pack_bshd(mask, spec, rank, need_roll=True)[0])
        return MtpTargets(self.pack_thd(x, spec, rank, need_roll=True).rows,
                          self.pack_thd(mask, spec, rank, need_roll=True).rows,
                          self.pack_thd(x, spec, rank).positions, factor)

    def replayed_routes(self, micro_batch: Any, spec: PackSpec, rank: int, *, mode: str) -> RoutesHanded:
        """What ``rank``'s routers replay (the module docstring) of the micro-batch's ``routed_experts`` (nested
        ``(B, j, layers, top_k)``; R3: a sequence's may lack its last token's): the routes packed like the ids, split
        over TP; R2 every row, R3 a generating sequence's rows but its last."""
        ids, routes = micro_batch["input_ids"], micro_batch["routed_experts"]
        lens = ids.offsets().diff().tolist()
        full = nested_from([torch.cat([r, r.new_zeros(n - r.shape[0], *r.shape[1:])]) for r, n in
                            zip(routes.unbind(), lens)])
        rows = self.pack_thd(full, spec, rank).rows[0]
        masks: list[torch.Tensor | None] = [None] * spec.tp
        if mode == "R3":
            generating = micro_batch["response_mask"].offsets().diff().tolist()
            replay = nested_from([torch.arange(n) < (n - 1 if g > 0 else 0) for n, g in zip(lens, generating)])
            masks = list(self.pack_thd(replay, spec, rank).rows[0].chunk(spec.tp))
        return RoutesHanded(list(rows.chunk(spec.tp)), masks)

    def recorded_routes(self, micro_batch: Any, recorded: list[list[torch.Tensor]], spec: PackSpec) -> torch.Tensor:
        """Every token's route (nested ``(B, j, layers, top_k)``) from what each CP rank's TP ranks' routers recorded
        on their rows (``recorded[cp][tp]``) in the micro-batch's forward."""
        ids = micro_batch["input_ids"]
        shards = []
        for rank, parts in enumerate(recorded):
            shard = self.pack_thd(ids, spec, rank)
            shards.append(ThdShard(torch.cat(parts).unsqueeze(0), shard.positions, shard.cu_seqlens_padded))
        return self.unpack_thd(shards, ids, spec)
