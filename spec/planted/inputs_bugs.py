"""Planted bugs in prepare_model_inputs: mask, labels, temperature, padding, config checks."""

from __future__ import annotations

import torch

import impl
from impl.flags import read_flag

from ..protocol.profile import ROUTES_SWITCH, ConfigSwitch
from ..truth.routes import routes_of

def _is_padded(mb) -> bool:
    return not read_flag(mb, "use_remove_padding", True)


def _lens(nested: torch.Tensor) -> torch.Tensor:
    return nested.offsets().diff()


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


class ShardRoll(impl.LMHeadEngine):
    """Sequence parallel: labels are rolled within each rank's shard instead of the global row."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size > 1 and "temperature_rmpad" in oa:
            oa["input_ids_rmpad_rolled"] = torch.roll(mi["input_ids"][0], -1)
            if "shift_labels" in mi:
                mi["shift_labels"] = oa["input_ids_rmpad_rolled"].unsqueeze(0)
        return mi, oa


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


class MaskAsBool(impl.LMHeadEngine):
    """The padded attention mask is a bool tensor instead of int32."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None:
            mi["attention_mask"] = mi["attention_mask"].bool()
        return mi, oa


class PadWithZero(impl.LMHeadEngine):
    """Padded input_ids are filled with 0 whatever pad_token_id says."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None:
            mi["input_ids"] = mi["input_ids"].masked_fill(mi["attention_mask"] == 0, 0)
        return mi, oa


class MropePaddedNotTransposed(impl.LMHeadEngine):
    """Padded mRoPE positions are left as (B, 4, L) instead of (4, B, L)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None and mi["position_ids"].dim() == 3:
            mi["position_ids"] = mi["position_ids"].transpose(0, 1).contiguous()
        return mi, oa


class PackedPositionsGlobal(impl.LMHeadEngine):
    """Packed positions run 0..total-1 over the whole row (sequences no longer restart at 0)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is None:
            pos = mi["position_ids"]
            start = self.settings.sp_rank * pos.shape[-1]
            mi["position_ids"] = torch.arange(start, start + pos.shape[-1], device=pos.device).expand_as(pos).clone()
        return mi, oa


class LabelsNotRolled(impl.LMHeadEngine):
    """The padded branch scores each token itself instead of the next one (no roll)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi["attention_mask"] is not None:
            oa["input_ids_rmpad_rolled"] = mb["input_ids"].values().clone()
        return mi, oa


class WritesFlagIntoBatch(impl.LMHeadEngine):
    """prepare_model_inputs records max_seq_len in the caller's micro-batch."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        mb.set_non_tensor("max_seq_len", int(_lens(mb["input_ids"]).max()))
        return mi, oa


def _as_no_padding(mb):
    if read_flag(mb, "pad_mode", "no_padding") != "no_padding":
        mb = mb.clone()
        mb.set_non_tensor("pad_mode", "no_padding")
    return mb


class PadModeUnchecked(impl.LMHeadEngine):
    """Any pad_mode is accepted and treated as no_padding."""

    def prepare_model_inputs(self, mb):
        return super().prepare_model_inputs(_as_no_padding(mb))

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        return super().prepare_model_outputs(output, oa, _as_no_padding(mb), logits_processor_func, **kw)


class FusedTemperatureTensor(impl.LMHeadEngine):
    """Fused kernels get the temperature as a (B,) tensor instead of one float."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "return_dict" in mi:
            mi["temperature"] = torch.full((len(_lens(mb["input_ids"])),), mi["temperature"])
        return mi, oa


class FloatTemperatureIgnored(impl.LMHeadEngine):
    """A float temperature flag is ignored (only a tensor temperature is applied)."""

    def prepare_model_inputs(self, mb):
        temp = read_flag(mb, "temperature", 1.0)
        if not isinstance(temp, torch.Tensor) and not read_flag(mb, "use_fused_kernels", False):
            mb = mb.clone()
            mb.set_non_tensor("temperature", 1.0)
        return super().prepare_model_inputs(mb)


class TemperatureBySortedLengths(impl.LMHeadEngine):
    """Padded per-sample temperatures are taken in length-sorted order (as if the batch were sorted)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "temperature" in oa:
            order = torch.argsort(_lens(mb["input_ids"]), descending=True, stable=True)
            oa["temperature"] = oa["temperature"][order.to(oa["temperature"].device)]
        return mi, oa


class CuSeqlensNotExtended(impl.LMHeadEngine):
    """cu_seqlens keeps the sequences' offsets only: the appended padding gets no final boundary."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "cu_seqlens" in mi and oa.get("pad_size"):
            mi["cu_seqlens"] = mi["cu_seqlens"][:-1]
            mi["cu_seqlens_cpu"] = mi["cu_seqlens_cpu"][:-1]
        return mi, oa


class RollAfterPadding(impl.LMHeadEngine):
    """The packed row is padded (bucket / sequence parallel) before it is rolled."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        pad = oa.get("pad_size", 0)
        if pad and self.settings.sp_size == 1:
            row = torch.cat([mb["input_ids"].values(), mi["input_ids"].new_zeros(pad)])
            oa["input_ids_rmpad_rolled"] = torch.roll(row, -1)
        return mi, oa


# -- layout deviations: harmless to consumers, caught only by the layout profile's invariants -------


class TailIdsPadToken(impl.LMHeadEngine):
    """The packed tail padding holds pad_token_id instead of verl's 0 (nothing reads it)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        pad = oa.get("pad_size", 0)
        if pad and self.settings.sp_size == 1:
            ids = mi["input_ids"].clone()
            ids[..., -pad:] = int(read_flag(mb, "pad_token_id", 0)) or 1
            mi["input_ids"] = ids
        return mi, oa


class PaddedPositionsFillOne(impl.LMHeadEngine):
    """Padded position_ids hold 1 after each sequence instead of verl's 0 (masked: nothing reads them)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi.get("attention_mask") is not None:
            pad = mi["attention_mask"] == 0
            mi["position_ids"] = mi["position_ids"].masked_fill(pad.expand_as(mi["position_ids"]), 1)
        return mi, oa


class FusedWithoutReturnDict(impl.LMHeadEngine):
    """Fused kernels are called without return_dict=True (verl passes it)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        mi.pop("return_dict", None)
        return mi, oa


class CuSeqlensWithoutCpuCopy(impl.LMHeadEngine):
    """cu_seqlens is passed without verl's CPU copy cu_seqlens_cpu."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        mi.pop("cu_seqlens_cpu", None)
        return mi, oa


class PaddedIdsLeftAligned(impl.LMHeadEngine):
    """Padded input_ids are left-padded (each sequence right-aligned) while the mask stays right-padded."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi.get("attention_mask") is not None:
            ids = mi["input_ids"]
            width = ids.shape[1]
            shift = (width - _lens(mb["input_ids"]).to(ids.device)).unsqueeze(1)
            cols = (torch.arange(width, device=ids.device).unsqueeze(0) - shift) % width
            mi["input_ids"] = ids.gather(1, cols)
        return mi, oa


class RoutesOneTokenLate(impl.LMHeadEngine):
    """With ``routed_experts`` on (router replay: the engine collates the rollout's routes per token), the routes are
    laid over the packed row one token late (each token handed the route of the token before it, the row's first
    that of the last): every sample's routes land on the next token, the first sample's on the second
    (INV-ROUTE-001)."""

    def __init__(self, **settings):
        self.routes_on = settings.pop(ROUTES_SWITCH, None)
        super().__init__(**settings)

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        routes = routes_of(mb)
        if self.routes_on and routes is not None:
            lens = [int(t.shape[0]) for t in routes]
            rows = torch.cat([torch.where(t.flatten(1).any(1).reshape(-1, 1, 1), t, _distinct(t)) for t in routes])
            oa = {**oa, "routes": list(rows.roll(1, 0).split(lens))}
        return mi, oa


def _distinct(routes: torch.Tensor) -> torch.Tensor:
    """Routes of distinct experts ``0..k-1`` in every layer, shaped as ``routes`` (a token without a captured one)."""
    return torch.arange(routes.shape[-1], dtype=routes.dtype).expand(routes.shape)


#: the switch RoutesOneTokenLate hides behind (the routes' dtype: verl's agent loop hands int16)
ROUTES = ConfigSwitch(ROUTES_SWITCH, (None, "int16"), "router replay: the rollout's routed experts collated per token")
