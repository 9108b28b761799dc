"""Quiet planted bugs: one-line mistakes real engines make that show only under one condition.

Each class docstring names the mistake and the condition (long sequences, ids above 65,535, bf16/fp16
logits, T < 0.1, a temperature at/below the 1e-8 clamp, the pad id among real tokens, holes in the
loss mask, B > 8, the last partial chunk, float32 logits, left padding of prompts, ...). Outside it
the engine is impl and passes every invariant.

Output-side bugs are written as "impl's correct result, then the buggy formula recomputed for the
tokens it affects", from the packed view of the model output (:func:`_tokens`), which keeps each one
a faithful copy of the one-line mistake without patching impl's modules.
"""

from __future__ import annotations

import torch

import impl
from impl.flags import read_flag

__all__ = [
    "LogSoftmaxInLogitsDtype", "EntropyLogsumexpMinusSum", "EntropyUntemperedAtLowTemperature",
    "SumPiSquaredTenfoldAtLowTemperature", "TemperatureClampMissing", "TemperatureInLogitsDtype",
    "LabelsMaskedAtPadId", "PaddedMaskFromPadId", "LabelIdsAsUint16", "PositionsClampedAt2048",
    "RollIn2048Chunks", "LabelsFromStorageStart", "TemperatureTableOfEight", "LastPartialChunkUntempered", "InplaceDivFloat32Logits",
    "ScaleBeforeUpcast", "left_right_valid_by_pad_id", "left_right_prompts_left_aligned",
    "left_right_response_len_from_mask_sum", "left_right_routed_experts_unmasked",
]


def _lens(mb) -> torch.Tensor:
    return mb["input_ids"].offsets().diff()


def _tokens(engine, output, oa, mb):
    """``(logits (N, V), temperature (N,), labels (N,))`` of the N real tokens in packed order, or None
    under sequence parallelism (each rank holds a slice: the quiet bugs leave those runs alone)."""
    if engine.settings.sp_size > 1 or getattr(output, "logits", None) is None:
        return None
    logits = output.logits
    lens = _lens(mb).to(logits.device)
    total = int(lens.sum())
    if read_flag(mb, "use_remove_padding", True):
        rows = logits[0, :total]
        temps = oa["temperature_rmpad"][:total]
    else:
        mask = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) < lens.unsqueeze(1)
        rows = logits[mask]
        temps = torch.repeat_interleave(oa["temperature"].to(logits.device), lens)
    labels = oa["input_ids_rmpad_rolled"][:total]
    return rows, temps, labels


def _replace(out: dict, key: str, values: torch.Tensor) -> None:
    if key in out:
        out[key] = torch.nested.nested_tensor_from_jagged(values.float().to(out[key].device), out[key].offsets())


def _stats(z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    lsm = torch.log_softmax(z, dim=-1)
    probs = lsm.exp()
    return {"log_probs": lsm.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1),
            "entropy": -(probs * lsm).sum(-1), "sum_pi_squared": (probs * probs).sum(-1)}


class _OutputBug(impl.LMHeadEngine):
    """impl, then :meth:`redo` recomputes some keys from the real tokens' logits when it applies."""

    keys = ("log_probs",)

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        view = _tokens(self, output, oa, mb)
        if view is not None and not read_flag(mb, "use_fused_kernels", False):
            redone = self.redo(*view)
            for key in self.keys:
                if redone is not None and key in redone:
                    _replace(out, key, redone[key])
        return out

    def redo(self, logits, temps, labels):  # pragma: no cover - overridden
        return None


class LogSoftmaxInLogitsDtype(_OutputBug):
    """log_softmax runs in the logits' dtype (no upcast to float32): wrong only for bf16/fp16 logits."""

    def redo(self, logits, temps, labels):
        if logits.dtype == torch.float32:
            return None
        z = logits / temps.clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)
        return _stats(z, labels)


class EntropyLogsumexpMinusSum(_OutputBug):
    """Entropy as logsumexp(z) - sum(softmax(z) * z) in float32: cancels when |z| is large (T < 0.1)."""

    keys = ("entropy",)

    def redo(self, logits, temps, labels):
        z = logits.float() / temps.clamp(min=1e-8).unsqueeze(-1)
        return {"entropy": torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)}


class EntropyUntemperedAtLowTemperature(EntropyLogsumexpMinusSum):
    """Entropy as logsumexp(z) - sum(softmax(z) * z), whose low-temperature branch (T < 0.1) forgets to
    divide by T: the engine claims verl's float32-cancellation record there, which must not excuse an error
    beyond what cancellation can make."""

    def redo(self, logits, temps, labels):
        tempered = super().redo(logits, temps, labels)["entropy"]
        untempered = super().redo(logits, torch.ones_like(temps), labels)["entropy"]
        return {"entropy": torch.where(temps < 0.1, untempered, tempered)}


class SumPiSquaredTenfoldAtLowTemperature(_OutputBug):
    """sum_pi_squared 10x too large below T = 0.1 (or over a vocabulary above 32,768): where the engine
    claims verl's float32-cancellation record, which must not excuse an error beyond that mechanism."""

    keys = ("sum_pi_squared",)

    def redo(self, logits, temps, labels):
        z = logits.float() / temps.clamp(min=1e-8).unsqueeze(-1)
        spq = torch.softmax(z, -1).pow(2).sum(-1)
        wide = logits.shape[-1] > 32_768
        return {"sum_pi_squared": torch.where((temps < 0.1) | wide, spq * 10, spq)}


class TemperatureClampMissing(_OutputBug):
    """Logits are divided by the raw temperature (the 1e-8 clamp is missing): wrong only below 1e-8."""

    keys = ("log_probs", "entropy", "sum_pi_squared")

    def redo(self, logits, temps, labels):
        if bool((temps >= 1e-8).all()):
            return None
        return _stats(logits.float() / temps.unsqueeze(-1), labels)


class TemperatureInLogitsDtype(_OutputBug):
    """The temperature is cast to the logits' dtype before dividing: bf16/fp16 round T (e.g. 0.7)."""

    keys = ("log_probs", "entropy", "sum_pi_squared")

    def redo(self, logits, temps, labels):
        if logits.dtype == torch.float32:
            return None
        return _stats(logits.float() / temps.clamp(min=1e-8).to(logits.dtype).float().unsqueeze(-1), labels)


class ScaleBeforeUpcast(_OutputBug):
    """logits / T is computed in the logits' dtype, then upcast: fp16 overflows at low T, bf16 rounds z."""

    keys = ("log_probs", "entropy", "sum_pi_squared")

    def redo(self, logits, temps, labels):
        if logits.dtype == torch.float32:
            return None
        return _stats((logits / temps.clamp(min=1e-8).unsqueeze(-1).to(logits.dtype)).float(), labels)


class LastPartialChunkUntempered(_OutputBug):
    """The chunked loop's remainder chunk is computed from unscaled logits (T forgotten there):
    wrong only when chunking leaves a partial last chunk and T != 1."""

    keys = ("log_probs", "entropy", "sum_pi_squared")

    def redo(self, logits, temps, labels):
        size = self.settings.entropy_chunk_size or max(1, impl.logits.CHUNK_BYTES // (4 * logits.shape[-1]))
        total = logits.shape[0]
        tail = total % size
        if total <= size or not tail:
            return None
        z = logits.float() / temps.clamp(min=1e-8).unsqueeze(-1)
        z[total - tail:] = logits[total - tail:].float()
        return _stats(z, labels)


class InplaceDivFloat32Logits(impl.LMHeadEngine):
    """``logits = output.logits.float(); logits.div_(T)``: .float() is a no-op on float32 logits, so the
    model's own logits are divided in place, only when they are float32 (and T != 1)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.shape[-1] > 1:
            temps = oa.get("temperature_rmpad", oa.get("temperature"))
            first = float(temps.reshape(-1)[0]) if isinstance(temps, torch.Tensor) else 1.0
            logits.float().div_(max(first, 1e-8))
        return out


class LabelsMaskedAtPadId(impl.LMHeadEngine):
    """Labels equal to pad_token_id are replaced by 0 (HF-style "ignore the pad label"): wrong where a real
    token, e.g. eos == pad, is the pad id (and the pad id is not 0)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        pad = int(read_flag(mb, "pad_token_id", 0))
        labels = oa["input_ids_rmpad_rolled"]
        oa["input_ids_rmpad_rolled"] = labels.masked_fill(labels == pad, 0)
        return mi, oa


class PaddedMaskFromPadId(impl.LMHeadEngine):
    """The padded attention mask is ``input_ids != pad_token_id``: wrong where a real token is the pad id."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi.get("attention_mask") is not None:
            pad = int(read_flag(mb, "pad_token_id", 0))
            mi["attention_mask"] = (mi["input_ids"] != pad).to(torch.int32)
        return mi, oa


class LabelIdsAsUint16(impl.LMHeadEngine):
    """Rolled label ids are stored as uint16 (to save memory): ids above 65,535 wrap."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        oa["input_ids_rmpad_rolled"] = oa["input_ids_rmpad_rolled"] & 0xFFFF
        if "shift_labels" in mi:
            mi["shift_labels"] = mi["shift_labels"] & 0xFFFF
        return mi, oa


class LabelIdsAsInt16(_OutputBug):
    """Label ids are kept as int16 (a vocabulary "fits in 16 bits" below 65,536 ids) and read back by Python-style
    indexing, where a negative id counts from the vocabulary's end: ids 32,768 .. 65,535 wrap to another token,
    only in vocabularies between 32,769 and 65,536 ids (Mistral-Nemo-sized, GPT-2's 50,257)."""

    def redo(self, logits, temps, labels):
        vocab = logits.shape[-1]
        if vocab > 65_536 or not bool((labels >= 32_768).any()):
            return None
        z = logits.float() / temps.clamp(min=1e-8).unsqueeze(-1)
        return _stats(z, labels.to(torch.int16).long() % vocab)


class PositionsClampedAt2048(impl.LMHeadEngine):
    """Position ids are clamped to a 2,048-entry rotary table: wrong only in sequences over 2,048 tokens."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        mi["position_ids"] = mi["position_ids"].clamp(max=2047)
        return mi, oa


class RollIn2048Chunks(impl.LMHeadEngine):
    """Labels are rolled inside fixed 2,048-token buffers: the label at each buffer's last slot is the
    buffer's first token: wrong only when total_nnz > 2,048."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        ids = mb["input_ids"].values()
        labels = oa["input_ids_rmpad_rolled"]
        if self.settings.sp_size == 1 and ids.shape[0] > 2048:
            labels = labels.clone()
            ends = torch.arange(2047, ids.shape[0], 2048, device=ids.device)
            labels[ends] = ids[ends - 2047].to(labels.dtype)
            oa["input_ids_rmpad_rolled"] = labels
            if "shift_labels" in mi:
                mi["shift_labels"] = labels[: mi["shift_labels"].shape[-1]].unsqueeze(0)
        return mi, oa


class LabelsFromStorageStart(impl.LMHeadEngine):
    """Rolled labels are a zero-copy shift, ``torch.as_strided(values, (n - 1,), (1,), 1)`` then the first id: the
    storage offset 1 is absolute, so a micro-batch split from a mini-batch (values a view at a storage offset)
    reads the tokens stored before it."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        ids = mb["input_ids"].values()
        if self.settings.sp_size == 1 and self.settings.pad_to_length is None and ids.shape[0] > 1:
            labels = torch.cat([torch.as_strided(ids, (ids.shape[0] - 1,), (1,), 1), ids[:1]])
            oa["input_ids_rmpad_rolled"] = labels.to(oa["input_ids_rmpad_rolled"].dtype)
            if "shift_labels" in mi:
                mi["shift_labels"] = oa["input_ids_rmpad_rolled"].unsqueeze(0)
        return mi, oa


class TemperatureTableOfEight(impl.LMHeadEngine):
    """Per-sample temperatures are read from an 8-slot table (``t[i % 8]``): wrong only for B > 8."""

    def prepare_model_inputs(self, mb):
        temp = mb.get("temperature") if "temperature" in mb.keys() else None
        if isinstance(temp, torch.Tensor) and temp.dim() == 1 and temp.shape[0] > 8:
            mb = mb.clone()
            mb["temperature"] = temp[torch.arange(temp.shape[0], device=temp.device) % 8]
        return super().prepare_model_inputs(mb)


# -- left_right_2_no_padding ---------------------------------------------------------------------


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    lens = torch.tensor([r.shape[0] for r in rows])
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), torch.nn.functional.pad(lens.cumsum(0), (1, 0)))


def left_right_valid_by_pad_id(data):
    """left_right_2_no_padding finds the real tokens as ``input_ids != pad_token_id`` (the pad id read off
    a padded slot) instead of the attention mask: wrong where a real token is the pad id."""
    out = impl.left_right_2_no_padding(data)
    ids, mask = data["input_ids"], data["attention_mask"].bool()
    if bool(mask.all()):
        return out
    pad = ids[~mask][0]
    out["input_ids"] = _nested([row[row != pad] for row in ids])
    return out


def left_right_prompts_left_aligned(data):
    """Nested prompts are each row's first p_i prompt columns, as if prompts were right-padded: wrong
    when prompts of different lengths are left-padded."""
    out = impl.left_right_2_no_padding(data)
    width = data["response_mask"].shape[1]
    prompt_cols = data["input_ids"][:, :-width]
    lens = data["attention_mask"][:, :-width].sum(1)
    out["prompts"] = _nested([row[:n] for row, n in zip(prompt_cols, lens.tolist())])
    return out


def left_right_response_len_from_mask_sum(data):
    """Nested responses take their lengths from response_mask.sum(): short when the mask has holes."""
    out = impl.left_right_2_no_padding(data)
    width = data["response_mask"].shape[1]
    lens = data["response_mask"].sum(1).clamp(min=1)
    out["responses"] = _nested([row[:n] for row, n in zip(data["input_ids"][:, -width:], lens.tolist())])
    return out


def left_right_routed_experts_unmasked(data):
    """routed_experts are nested from each row's first n_i columns (the left padding is not skipped)."""
    out = impl.left_right_2_no_padding(data)
    if "routed_experts" in data.keys():
        lens = data["attention_mask"].sum(1).tolist()
        out["routed_experts"] = _nested([row[:n] for row, n in zip(data["routed_experts"], lens)])
    return out
