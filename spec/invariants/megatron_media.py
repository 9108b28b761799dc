"""A vision-language micro-batch through a Megatron-style engine (spec/truth/megatron_packing.py, ``vlm_inputs``):
the model packs for itself, after its vision tower, so what it is handed must let it put each image's features at
that image's tokens and its outputs where the labels are packed. Each example checks every TP in {1, 2, 4} x CP in
{1, 2, 4} x CP layout the engine offers, every CP rank, THD and BSHD.
"""

from __future__ import annotations

import itertools

import torch

from ..cases.materialize import draws, materialize
from ..cases.media import with_media
from ..protocol.engine import media_view
from ..protocol.profile import MEDIA_INPUT_KEYS
from ..truth.media_checks import media_inputs_handed
from ..truth.megatron_packing import PackSpec
from ..truth.vision import media_token_ids
from .core import Ctx, fail, invariant
from .megatron import ANY, SIZES, _at

NEEDS = ("packing", "media")


def _specs(ctx: Ctx) -> list[PackSpec]:
    """TP x CP x the engine's layouts, FP8 as the packing invariants draw it (the static bucket is theirs)."""
    fp8 = ctx.case.seed // 3 % 4 == 1
    layouts = ctx.engine.layouts
    return [PackSpec(tp, cp, layout, fp8=fp8) for tp, cp, layout in itertools.product(SIZES, SIZES, layouts)
            if cp > 1 or layout is layouts[0]]


def _rows_hold_samples(rows: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, what: str) -> None:
    seqs = ids.unbind()
    if rows.dim() != 2 or rows.shape[0] != len(seqs) or mask.shape != rows.shape:
        fail(f"{what}: input_ids {tuple(rows.shape)} and attention_mask {tuple(mask.shape)}: expected one row per "
             f"sample ({len(seqs)}), the mask as wide as the ids")
    for i, seq in enumerate(seqs):
        got = rows[i][mask[i].bool()].cpu()
        if not torch.equal(got, seq.cpu()):
            fail(f"{what}: row {i} holds {got.tolist()} under its mask, sample {i} is {seq.tolist()}")


TITLE = ("a vision-language micro-batch: the model is handed each sample's ids in its own row under the mask, the "
         "samples' features and grids in sample order beside as many media tokens, and the boundaries (THD) or the "
         "width (BSHD) its labels are packed with, on every rank of every TP x CP x layout")
PROTECTS = ("each image's features reach its own image tokens when the model packs after its vision tower, and its "
            "outputs come back where the labels are (ROLL #452, Automodel #2172: mRoPE/VLM packing)")


@invariant("INV-MEG-006", TITLE, contract=14, modes=ANY, needs=NEEDS, adjust=with_media, protects=PROTECTS)
def vision_handed(ctx: Ctx) -> None:
    """The model packs the rows' tokens under the mask (mbridge's vision-language models), so each row's masked ids
    are its sample's; INV-MM-001's check (:func:`~spec.truth.media_checks.media_inputs_handed`) on the features and
    grids; THD: its ``packed_seq_params`` boundaries are those of the THD packing of the ids (the labels'); BSHD: its
    rows are as wide as the BSHD labels' layout (``postprocess_bshd_engine`` reads the outputs there)."""
    micro_batch, packer = materialize(ctx.case), ctx.engine.packer
    ids = micro_batch["input_ids"]
    want = draws(ctx.case).media_inputs()
    groups = {kind: sum(m.tokens for items in ctx.case.media for m in items if m.kind == kind)
              for kind in MEDIA_INPUT_KEYS}
    for spec in _specs(ctx):
        for packed, rank in itertools.product((True, False), range(spec.cp)):
            what = f"[{spec}] {'THD' if packed else 'BSHD'} rank {rank}"
            with _at(spec):
                handed = packer.vlm_inputs(micro_batch, spec, rank, packed=packed)
                labels = packer.pack_thd(ids, spec, rank) if packed else packer.pack_bshd(ids, spec, rank)
            rows, mask = handed["input_ids"], handed["attention_mask"]
            _rows_hold_samples(rows, mask, ids, what)
            media_inputs_handed([(rows, media_view(handed))], want, *media_token_ids(ctx.case.vocab), rows[mask.bool()],
                                groups)
            if packed and not torch.equal(handed["cu_seqlens_padded"].cpu().long(), labels.cu_seqlens_padded.long()):
                fail(f"{what}: the model is handed the boundaries {handed['cu_seqlens_padded'].tolist()}, the labels "
                     f"are packed at {labels.cu_seqlens_padded.tolist()}")
            if not packed and rows.shape[1] != labels[1].shape[1] * spec.cp:
                fail(f"{what}: the model is handed rows {rows.shape[1]} wide, the labels' BSHD layout is "
                     f"{labels[1].shape[1] * spec.cp} wide ({spec.cp} ranks of {labels[1].shape[1]})")
