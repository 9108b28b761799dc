"""Planted bugs: small, plausible mistakes in an otherwise correct engine (impl).

Each entry names the invariant(s) that must reject it; ``tests/test_power.py`` asserts
that they do under the ``ci`` profile, and ``spec/README.md`` records the shrunk
counterexample each one produces. The first two are the seeds' historical verl bugs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import impl
from impl.flags import read_flag

from .impl_engine import ImplEngine

__all__ = ["PlantedBug", "PLANTED", "planted_engine"]


def _is_padded(mb) -> bool:
    return not read_flag(mb, "use_remove_padding", True)


def _lens(nested: torch.Tensor) -> torch.Tensor:
    return nested.offsets().diff()


# --- engine-level bugs -------------------------------------------------------------------------

class LossMaskAttention(impl.LMHeadEngine):
    """verl #6278: the padded attention mask is built from the response-only loss_mask."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None:
            width = mi["input_ids"].shape[1]
            resp = _lens(mb["loss_mask"]).to(mi["input_ids"].device)
            mi["attention_mask"] = (torch.arange(width, device=resp.device) < resp[:, None]).to(torch.int32)
        return mi, oa


class MaskOffByOne(impl.LMHeadEngine):
    """The padded mask drops each sequence's last token (n_i - 1 ones)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None:
            mask = mi["attention_mask"].clone()
            lens = mask.sum(1)
            mask[torch.arange(mask.shape[0]), (lens - 1).clamp(min=0)] = 0
            mi["attention_mask"] = mask
        return mi, oa


class DropDistillationPadded(impl.LMHeadEngine):
    """verl #6293: the padded branch forgets the logits processor's keys (KeyError downstream)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            out = {k: v for k, v in out.items() if k in ("log_probs", "entropy", "sum_pi_squared")}
        return out


class SumPiSquaredMissingPadded(impl.LMHeadEngine):
    """The padded branch ignores calculate_sum_pi_squared."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            out.pop("sum_pi_squared", None)
        return out


class ShardRoll(impl.LMHeadEngine):
    """Sequence parallel: labels are rolled within each rank's shard instead of the global row."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size > 1 and "temperature_rmpad" in oa:
            oa["input_ids_rmpad_rolled"] = torch.roll(mi["input_ids"][0], -1)
            if "shift_labels" in mi:
                mi["shift_labels"] = oa["input_ids_rmpad_rolled"].unsqueeze(0)
        return mi, oa


class NoTemperaturePadded(impl.LMHeadEngine):
    """The padded branch forgets to divide by temperature."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if "temperature" in oa:
            oa = {**oa, "temperature": torch.ones_like(oa["temperature"])}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class DoubleTemperature(impl.LMHeadEngine):
    """The packed branch divides by temperature twice."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if "temperature_rmpad" in oa:
            oa = {**oa, "temperature_rmpad": oa["temperature_rmpad"] ** 2}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class FirstSampleTemperature(impl.LMHeadEngine):
    """A per-sample temperature tensor is collapsed to its first value."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        for key in ("temperature_rmpad", "temperature"):
            if isinstance(oa.get(key), torch.Tensor):
                oa[key] = torch.full_like(oa[key], float(oa[key][0]))
        return mi, oa


class FusedTensorTemperatureAccepted(impl.LMHeadEngine):
    """Fused kernels silently take the first value of a per-sample temperature tensor."""

    def prepare_model_inputs(self, mb):
        temp = mb.get("temperature", None) if "temperature" in mb.keys() else None
        if read_flag(mb, "use_fused_kernels", False) and isinstance(temp, torch.Tensor) and temp.dim() == 1:
            mb = mb.clone()
            del mb["temperature"]
            mb.set_non_tensor("temperature", float(temp[0]))
        return super().prepare_model_inputs(mb)


class BucketTopKAccepted(impl.LMHeadEngine):
    """A static bucket is used with top-K distillation without complaint."""

    def prepare_model_inputs(self, mb):
        if self.settings.pad_to_length and read_flag(mb, "distillation_use_topk", False):
            quiet = mb.clone()
            quiet.set_non_tensor("distillation_use_topk", False)
            return super().prepare_model_inputs(quiet)
        return super().prepare_model_inputs(mb)


class BucketPositionsContinue(impl.LMHeadEngine):
    """The packed tail's positions continue the last sequence instead of restarting at 0."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        pad = oa.get("pad_size", 0)
        if pad and self.settings.sp_size == 1:
            pos = mi["position_ids"].clone()
            last = pos[..., -pad - 1: -pad]
            pos[..., -pad:] = last + torch.arange(1, pad + 1, device=pos.device)
            mi["position_ids"] = pos
        return mi, oa


class StripPadFromHead(impl.LMHeadEngine):
    """The packed tail padding is removed from the head of the row instead of the tail."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        pad = oa.get("pad_size", 0)
        if pad and self.settings.sp_size == 1:
            output = {k: torch.roll(v, -pad, dims=1) for k, v in vars(output).items() if isinstance(v, torch.Tensor)}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class GlobalMaxShift(impl.LMHeadEngine):
    """'Numerical stability': the padded logits are shifted by their global max, padding included."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        if _is_padded(mb) and getattr(output, "logits", None) is not None:
            logits = output.logits
            output = {"logits": logits - logits.amax(dim=(1, 2), keepdim=True),
                      **{k: v for k, v in vars(output).items() if k != "logits"}}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class MutateLogits(impl.LMHeadEngine):
    """Temperature is applied in place on the model's logits (the caller's tensor changes)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        logits = getattr(output, "logits", None)
        if logits is not None and not read_flag(mb, "use_fused_kernels", False):
            if "temperature_rmpad" in oa:
                logits[0].div_(oa["temperature_rmpad"].unsqueeze(-1))
                oa = {**oa, "temperature_rmpad": torch.ones_like(oa["temperature_rmpad"])}
            else:
                logits.div_(oa["temperature"].view(-1, 1, 1))
                oa = {**oa, "temperature": torch.ones_like(oa["temperature"])}
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class ValueTrailingDim(impl.ValueHeadEngine):
    """verl 0.7.1's value head: the padded branch keeps the trailing 1, (B, j, 1)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _is_padded(mb):
            v = out["values"]
            out["values"] = torch.nested.nested_tensor_from_jagged(v.values().unsqueeze(-1), v.offsets())
        return out


# --- helper bugs -------------------------------------------------------------------------------

def slice_without_shift(tensor, data):
    """no_padding_2_padding reads values[e-r : e] (forgets the model's one-position shift)."""
    shifted = torch.nested.nested_tensor_from_jagged(torch.roll(tensor.values(), -1, 0), tensor.offsets())
    return impl.no_padding_2_padding(shifted, data)


def slice_masked_by_multiplication(tensor, data):
    """no_padding_2_padding zeroes the padding by multiplying with the mask (NaN * 0 = NaN)."""
    values, offsets = tensor.values(), tensor.offsets()
    resp = data["responses"].offsets().diff().to(values.device)
    width = int(read_flag(data, "max_response_len", None) or resp.max())
    cols = torch.arange(width, device=values.device)
    src = (offsets[1:] - resp - 1).unsqueeze(1) + cols
    valid = cols < resp.unsqueeze(1)
    out = values[src.clamp(max=values.shape[0] - 1)]
    return out * valid.view(*valid.shape, *([1] * (out.dim() - 2))).to(out.dtype)


def slice_lengths_from_loss_mask_sum(tensor, data):
    """Response lengths are taken as loss_mask.sum() (wrong when the mask has holes)."""
    resp = torch.stack([t.sum() for t in data["loss_mask"].unbind()]).clamp(min=1)
    fake = torch.nested.nested_tensor_from_jagged(torch.zeros(int(resp.sum())), torch.nn.functional.pad(resp.cumsum(0), (1, 0)))
    view = data.clone()
    del view["responses"]
    view["responses"] = fake
    return impl.no_padding_2_padding(tensor, view)


def left_right_mutating(data):
    """left_right_2_no_padding replaces keys of its input (as verl's pops input_ids)."""
    out = impl.left_right_2_no_padding(data)
    data.pop("input_ids")
    data.set("input_ids", out["input_ids"])
    return out


def left_right_as_nested_positions(data):
    """left_right_2_no_padding builds mRoPE positions with as_nested_tensor (ragged dim guessed)."""
    out = impl.left_right_2_no_padding(data)
    pos = out["position_ids"]
    rows = list(pos.unbind())
    out["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return out


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
    PlantedBug("loss_mask_attention", ("INV-MASK-001", "INV-VAL-001", "INV-KEYS-003"), lm=LossMaskAttention),
    PlantedBug("drop_distillation_padded", ("INV-KEYS-001", "INV-VAL-004"), lm=DropDistillationPadded),
    PlantedBug("mask_off_by_one", ("INV-MASK-001", "INV-VAL-002"), lm=MaskOffByOne),
    PlantedBug("sum_pi_squared_missing_padded", ("INV-KEYS-002",), lm=SumPiSquaredMissingPadded),
    PlantedBug("shard_roll", ("INV-LABEL-002", "INV-SP-001"), lm=ShardRoll),
    PlantedBug("no_temperature_padded", ("INV-TEMP-001", "INV-VAL-001"), lm=NoTemperaturePadded),
    PlantedBug("double_temperature", ("INV-TEMP-001", "INV-VAL-001"), lm=DoubleTemperature),
    PlantedBug("first_sample_temperature", ("INV-TEMP-001",), lm=FirstSampleTemperature),
    PlantedBug("fused_tensor_temperature_accepted", ("INV-ERR-003",), lm=FusedTensorTemperatureAccepted),
    PlantedBug("bucket_topk_accepted", ("INV-ERR-002",), lm=BucketTopKAccepted),
    PlantedBug("bucket_positions_continue", ("INV-PAD-001",), lm=BucketPositionsContinue),
    PlantedBug("strip_pad_from_head", ("INV-SP-002",), lm=StripPadFromHead),
    PlantedBug("global_max_shift", ("INV-LEAK-001",), lm=GlobalMaxShift),
    PlantedBug("mutate_logits", ("INV-MUT-002",), lm=MutateLogits),
    PlantedBug("value_trailing_dim", ("INV-VAL-005",), value=ValueTrailingDim),
    PlantedBug("slice_without_shift", ("INV-SLICE-002", "INV-SLICE-003"),
               helpers=(("no_padding_2_padding", slice_without_shift),)),
    PlantedBug("slice_masked_by_multiplication", ("INV-SLICE-003",),
               helpers=(("no_padding_2_padding", slice_masked_by_multiplication),)),
    PlantedBug("slice_lengths_from_loss_mask_sum", ("INV-SLICE-002",),
               helpers=(("no_padding_2_padding", slice_lengths_from_loss_mask_sum),)),
    PlantedBug("left_right_mutating", ("INV-MUT-003",), helpers=(("left_right_2_no_padding", left_right_mutating),)),
    PlantedBug("left_right_as_nested_positions", ("INV-DENSE-002",),
               helpers=(("left_right_2_no_padding", left_right_as_nested_positions),)),
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
