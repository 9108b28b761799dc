"""Planted multi-modal bugs: impl handing the model a vision-language micro-batch's images wrong, each a mistake real
engines made (verl #1623/#3315: keys lost; ROLL #452 and NeMo Automodel #2172: the rope of packed mRoPE) or could
make, and an audio micro-batch's clips padded wrong (verl's ``_pad_last_dim_and_cat`` class). Quiet: each shows only
on a micro-batch with images (or clips of unequal lengths; outside one the engine is impl); the last one is in the
micro-batch layer (a sample's ``multi_modal_inputs`` left behind when the balancing reorders the samples).
"""

from __future__ import annotations

import torch
from tensordict import NonTensorData, NonTensorStack

import impl
from impl.flags import read_flag

from ..protocol.microbatch import MicroBatchLayer
from ..protocol.profile import AUDIO_INPUT_KEYS, MEDIA_INPUT_KEYS

__all__ = ["MediaLastSampleDropped", "MediaReversed", "MediaShiftedOneGroup", "MediaLostPadded", "MediaGridsSorted",
           "AudioMaskPaddedWithOnes", "AudioClipsCutToShortest", "media_sliced_not_selected"]

_FEATURES = tuple(features for features, _ in MEDIA_INPUT_KEYS.values())
_MEDIA_KEYS = tuple(key for pair in MEDIA_INPUT_KEYS.values() for key in pair)
_AUDIO_MASK = AUDIO_INPUT_KEYS[1]


class MediaLastSampleDropped(impl.LMHeadEngine):
    """The features and grids of the last sample that has media are left out (a loop over samples that stops one
    short once a text-only sample shifted its index)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "multi_modal_inputs" in mb.keys():
            entries = [e if e else {} for e in mb.get("multi_modal_inputs").tolist()]
            with_media = [i for i, e in enumerate(entries) if e]
            if with_media:
                entries[with_media[-1]] = {}
                for key in _MEDIA_KEYS:
                    mi.pop(key, None)
                mi.update(impl.extract_multi_modal_inputs(entries, device=mi["input_ids"].device))
        return mi, oa


class MediaReversed(impl.LMHeadEngine):
    """The samples' media dicts concatenated last sample first (a stack read back to front)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "multi_modal_inputs" in mb.keys():
            entries = mb.get("multi_modal_inputs").tolist()[::-1]
            mi.update(impl.extract_multi_modal_inputs(entries, device=mi["input_ids"].device))
        return mi, oa


class MediaShiftedOneGroup(impl.LMHeadEngine):
    """The features rolled by one merged group (four patch rows): each image token gets its neighbour's embedding
    (an off-by-one in the merge window's start)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        for key in _FEATURES:
            if key in mi and mi[key].shape[0] > 4:
                mi[key] = mi[key].roll(4, 0)
        return mi, oa


class MediaLostPadded(impl.LMHeadEngine):
    """The padded path builds its model inputs afresh and forgets the media keys (the packed path keeps them)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if not read_flag(mb, "use_remove_padding", True):
            for key in _MEDIA_KEYS:
                mi.pop(key, None)
        return mi, oa


class MediaGridsSorted(impl.LMHeadEngine):
    """The image grids handed sorted by size (a bucketing step that reorders the grids but not the features): the
    counts agree, each image's patches are read under another image's grid."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        grid = mi.get("image_grid_thw")
        if grid is not None and grid.shape[0] > 1:
            order = torch.argsort(grid.prod(-1) * 1000 + grid[:, 1], stable=True)
            mi["image_grid_thw"] = grid[order]
        return mi, oa


class AudioMaskPaddedWithOnes(impl.LMHeadEngine):
    """An audio micro-batch's ``feature_attention_mask`` padded to the longest sample's frames with ones, not zeros
    (a pad value shared with the features' helper): the padding frames are read as audio. Quiet: only samples whose
    clips are of unequal lengths (one sample alone, or equal widths, pads nothing)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if _AUDIO_MASK in mi and "multi_modal_inputs" in mb.keys():
            masks = [e[_AUDIO_MASK] for e in mb.get("multi_modal_inputs").tolist()
                     if e and e.get(_AUDIO_MASK) is not None]
            width = mi[_AUDIO_MASK].shape[-1]
            mi[_AUDIO_MASK] = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1]), value=1)
                                         for m in masks]).to(mi[_AUDIO_MASK].device)
        return mi, oa


class AudioClipsCutToShortest(impl.LMHeadEngine):
    """An audio micro-batch's features and masks cut to the shortest sample's frames instead of padded to the
    longest (a ``min`` for a ``max``): a longer clip loses its last frames, and the audio tokens outnumber what the
    clips make. Quiet: only samples whose clips are of unequal lengths."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if _AUDIO_MASK in mi and "multi_modal_inputs" in mb.keys():
            entries = [e for e in mb.get("multi_modal_inputs").tolist() if e and e.get(_AUDIO_MASK) is not None]
            width = min(e[_AUDIO_MASK].shape[-1] for e in entries)
            for key in AUDIO_INPUT_KEYS:
                mi[key] = torch.cat([e[key][..., :width] for e in entries]).to(mi[key].device)
        return mi, oa


def media_sliced_not_selected(layer: MicroBatchLayer) -> MicroBatchLayer:
    """prepare_micro_batches selects every tensor by the balanced index lists but takes each micro-batch's
    ``multi_modal_inputs`` as the next consecutive entries of the mini-batch (a per-sample list sliced by position,
    as a non-tensor batch kept beside the tensors is): wherever the balancing reorders the samples, a micro-batch's
    images are other samples'. Quiet: only a vision-language mini-batch that the balancing reorders."""
    prepare = layer.get("prepare_micro_batches")

    def prepare_micro_batches(data, *args, **kwargs):
        micro, indices = prepare(data, *args, **kwargs)
        if indices is None or "multi_modal_inputs" not in data.keys():
            return micro, indices
        entries = data.get("multi_modal_inputs").tolist()
        start, out = 0, []
        for mb, part in zip(micro, indices):
            mb = mb.clone(recurse=False) if hasattr(mb, "clone") else mb
            mb.set("multi_modal_inputs", NonTensorStack.from_list(
                [NonTensorData(entry) for entry in entries[start:start + len(part)]]))
            start += len(part)
            out.append(mb)
        return out, indices

    return layer.with_functions("planted", prepare_micro_batches=prepare_micro_batches)
