"""The calling convention TRL and OpenRLHF share: per-sample tensors in, dense ``(B, L)`` outputs back out (part of
the adapter kit, docs/writing-an-adapter.md).

Both libraries take lists of per-sample token tensors (what ``generate`` or vLLM returns) and pad them with
their own functions. These helpers split the suite's nested micro-batch into such lists (:func:`samples`), lay
them out as ``generate`` returns them with the library's own pad function (:func:`left_right_rows`), put a
shifted packed row's values back on the sequences (:func:`from_shifted_row`) and read the single float
temperature both libraries take (:func:`one_temperature`); flags are read with the contract's typed reader
(``impl.flags.BatchFlags``). Response-only ``(B, R)`` outputs, left- or right-aligned, become nested ones
(:func:`sequences_from_response_rows`), or, read at the library's own response mask as its trainer reads them, SkyRL's
(:func:`sequences_from_masked_rows`). A vision-language micro-batch's images and
videos are read per sample (:func:`media_samples`, each sample's processor dict) with the model config's media token
ids beside them (:func:`media_token_ids`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from impl.flags import BatchFlags, read_flag

from ...cases.media import MEDIA_TOKEN_FLAGS, MULTI_MODAL_KEY
from ...protocol import sequences_from_responses
from ...protocol.errors import OneTemperatureError
from ...truth.media_checks import stack_entries

__all__ = ["samples", "one_temperature", "BatchFlags", "OneTemperatureError", "left_right_rows", "from_shifted_row",
           "LeftRightRows", "left_aligned", "sequences_from_response_rows", "sequences_from_masked_rows",
           "media_samples", "media_token_ids"]


def samples(mb, key: str) -> list[torch.Tensor]:
    """``mb[key]`` as one tensor per sample (mRoPE positions ``(4, n_i)`` as ``(n_i, 4)``: libraries pad dim 0)."""
    nested = mb[key]
    return [t.transpose(0, 1) if t.dim() == 2 else t for t in nested.unbind()]


def one_temperature(mb) -> float:
    """The single float temperature (a ``(B,)`` tensor of equal values counts as one)."""
    value = read_flag(mb, "temperature", 1.0)
    if isinstance(value, torch.Tensor):
        if value.numel() and bool((value != value.reshape(-1)[0]).any()):
            raise OneTemperatureError(f"temperature: a per-sample (B,) tensor {value.tolist()}; this library "
                                      "takes one temperature per trainer (a float)")
        value = value.reshape(-1)[0].item() if value.numel() else 1.0
    return float(value)


class LeftRightRows(NamedTuple):
    """A padded batch as Hugging Face ``generate`` returns it (``PaddedLayout.LEFT_RIGHT``)."""

    input_ids: torch.Tensor  # (B, P + R): prompts left-padded, responses right-padded
    attention_mask: torch.Tensor  # (B, P + R), the library's mask dtype
    position_ids: torch.Tensor  # each sample's own positions in that layout, (B, P + R) or mRoPE (4, B, P + R)
    response_width: int  # R: the completion columns (``logits_to_keep``)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model's keyword arguments (HF names)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def left_right_rows(mb, pad: Callable[..., torch.Tensor], pad_id: int) -> LeftRightRows:
    """The micro-batch's prompts and responses padded by the library's ``pad(tensors, value, side)`` (TRL's
    ``trl.trainer.utils.pad``) and concatenated: GRPO's batch. The positions are the micro-batch's own, laid out
    the same way (a library that hands the model none leaves the model to compute them)."""
    prompts, responses, pos = samples(mb, "prompts"), samples(mb, "responses"), samples(mb, "position_ids")
    completion = pad(responses, pad_id, "right")
    ids = torch.cat([pad(prompts, pad_id, "left"), completion], 1)
    mask = torch.cat([pad([torch.ones_like(p) for p in prompts], 0, "left"),
                      pad([torch.ones_like(r) for r in responses], 0, "right")], 1)
    positions = torch.cat([pad([q[:len(p)] for q, p in zip(pos, prompts)], 0, "left"),
                           pad([q[len(p):] for q, p in zip(pos, prompts)], 0, "right")], 1)
    return LeftRightRows(ids, mask, positions.permute(2, 0, 1) if positions.dim() == 3 else positions,
                         completion.shape[1])


def from_shifted_row(values: torch.Tensor, mb) -> torch.Tensor:
    """Per-token values of a packed row shifted by one (``(1, n - 1)``: each token scores the next, the row's last
    token nothing; a row padded at its tail past the sequences' tokens is cut there) as a nested tensor over the
    sequences, with 0 at the last token (which no consumer reads)."""
    offsets = mb["input_ids"].offsets()
    row = values[0, : int(offsets[-1]) - 1]
    return torch.nested.nested_tensor_from_jagged(torch.cat([row, row.new_zeros(1)]).float(), offsets)


def left_aligned(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``(B, R, *)`` rows whose row i holds its ``lengths[i]`` values in its last columns (right-aligned), moved to
    its first columns (what :func:`spec.protocol.sequences_from_responses` reads)."""
    width = rows.shape[1]
    index = (torch.arange(width, device=rows.device) - lengths.to(rows.device).unsqueeze(1)) % width
    return torch.gather(rows, 1, index.reshape(*index.shape, *[1] * (rows.dim() - 2)).expand_as(rows))


def sequences_from_response_rows(outputs: dict[str, torch.Tensor | None], mb, *,
                                 right_aligned: bool = False) -> dict[str, torch.Tensor]:
    """Response-only ``(B, R)`` outputs (``OutputSpan.RESPONSE``) as nested tensors over the sequences
    (:func:`spec.protocol.sequences_from_responses`); ``right_aligned``: row i holds its ``r_i`` values in its last
    columns (whole rows left-padded), moved first (:func:`left_aligned`). An output that is None is left out."""
    lens = mb["responses"].offsets().diff()
    return {key: sequences_from_responses(left_aligned(rows, lens) if right_aligned else rows, mb)
            for key, rows in outputs.items() if rows is not None}


def sequences_from_masked_rows(outputs: dict[str, torch.Tensor | None], mb, mask: torch.Tensor
                               ) -> dict[str, torch.Tensor]:
    """Response-only ``(B, R)`` outputs read where the library's own response mask ``(B, R)`` is set, row by row in
    order, as its trainer reads them (SkyRL's ``response_mask``, 0.3.1's ``action_mask``), as nested tensors over the
    sequences. A mask that does not mark each row's ``r_i`` response tokens is a ValueError naming its shape and
    counts. An output that is None is left out."""
    lens, keep = mb["responses"].offsets().diff(), mask.bool()
    counts = keep.sum(-1).cpu()
    if not torch.equal(counts, lens.cpu()):
        raise ValueError(f"response_mask of shape {tuple(mask.shape)} marks {counts.tolist()} tokens per row; the "
                         f"responses have {lens.tolist()}")
    first = torch.arange(keep.shape[-1], device=keep.device) < lens.to(keep.device).unsqueeze(1)  # where they go
    out = {}
    for key, rows in outputs.items():
        if rows is None:
            continue
        if tuple(rows.shape[:2]) != tuple(keep.shape):
            raise ValueError(f"{key!r} of shape {tuple(rows.shape)} is not read by a response_mask of shape "
                             f"{tuple(mask.shape)}")
        moved = rows.new_zeros(rows.shape)  # each row's marked values first, in order (what the protocol reads)
        moved[first.to(rows.device)] = rows[keep.to(rows.device)]
        out[key] = sequences_from_responses(moved, mb)
    return out


def media_samples(mb) -> list[dict[str, torch.Tensor]] | None:
    """Each sample's images and videos as its processor returned them (``multi_modal_inputs``: ``pixel_values``,
    ``image_grid_thw``, the video keys), ``{}`` for a text-only sample (an entry ``None``, or keys holding None,
    dropped); None for a micro-batch without ``multi_modal_inputs`` (a text-only batch)."""
    if MULTI_MODAL_KEY not in mb.keys():
        return None
    entries = stack_entries(mb.get(MULTI_MODAL_KEY))
    return [{k: v for k, v in (entry or {}).items() if v is not None} for entry in entries]


def media_token_ids(mb) -> tuple[int, int]:
    """The model config's image and video token ids a vision-language micro-batch carries beside its media (a
    library that marks the media tokens itself reads them from its model's config: ``config.image_token_id``)."""
    return tuple(int(read_flag(mb, key, -1)) for key in MEDIA_TOKEN_FLAGS)
