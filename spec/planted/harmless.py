"""Harmless engines: impl changed where no consumer can tell, which the verdict must pass.

Each differs from impl only in memory, in a value nobody reads, or in a layout choice the
contract leaves open: a check that rejects one is a false alarm (it belongs, at most, to the
separately reported layout profile). ``tests/test_harmless.py`` runs the conformance verdict
(every non-layout invariant) against each under the ``ci`` profile. Load one with
``python -m spec verify --engine spec.planted.harmless:<Name>`` (e.g. ``PerSequenceLabels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import impl
from impl.flags import read_flag

from ..engines.impl.adapter import ImplEngine

__all__ = ["HARMLESS", "HarmlessEngine", "harmless_engine", "ContiguousCopies", "PerSequenceLabels", "TailPadIds",
           "CuSeqlensInt64", "RowShapedOutputArgs", "LastLabelPad", "UnreadOutputsZeroed"]


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return torch.nested.nested_tensor_from_jagged(value.values().clone(), value.offsets().clone(),
                                                          jagged_dim=getattr(value, "_ragged_idx", 1))
        return value.clone()
    return value


class _ContiguousCopiesLM(impl.LMHeadEngine):
    """Memory only: every tensor it returns is a fresh copy (no views of the batch, the labels or the outputs)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        return {k: _cloned(v) for k, v in mi.items()}, {k: _cloned(v) for k, v in oa.items()}

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        return {k: _cloned(v) for k, v in out.items()}


def _sequence_ends(mb, device) -> torch.Tensor:
    """Packed index of each sequence's last token."""
    return mb["input_ids"].offsets()[1:].to(device) - 1


def _sequence_starts(mb, device) -> torch.Tensor:
    return mb["input_ids"].offsets()[:-1].to(device)


class _PerSequenceLabelsLM(impl.LMHeadEngine):
    """A different label at each sequence's last token: the roll wraps within the sequence (the label is
    the sequence's own first token), not into the next sequence (verl issue #6475's alternative). That
    label's log-prob is never part of a response slice: nobody reads it."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size != 1:  # each rank holds a slice of the labels; keep the global roll there
            return mi, oa
        labels = oa["input_ids_rmpad_rolled"].clone()
        ids = mb["input_ids"].values().to(labels.device)
        labels[_sequence_ends(mb, labels.device)] = ids[_sequence_starts(mb, labels.device)]
        oa = {**oa, "input_ids_rmpad_rolled": labels}
        if "shift_labels" in mi:
            mi = {**mi, "shift_labels": labels.unsqueeze(0)}
        return mi, oa


class _LastLabelPadLM(impl.LMHeadEngine):
    """A different label at each sequence's last token: ``pad_token_id`` (a token nobody scores)."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size != 1:
            return mi, oa
        labels = oa["input_ids_rmpad_rolled"].clone()
        labels[_sequence_ends(mb, labels.device)] = int(read_flag(mb, "pad_token_id", 0))
        oa = {**oa, "input_ids_rmpad_rolled": labels}
        if "shift_labels" in mi:
            mi = {**mi, "shift_labels": labels.unsqueeze(0)}
        return mi, oa


class _TailPadIdsLM(impl.LMHeadEngine):
    """Another pad value where nothing reads it: the packed tail (static bucket, sequence-parallel pad)
    holds token id 1 instead of 0. The tail's positions restart at 0, so it is a separate sequence for
    the model, and its outputs are dropped."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if not read_flag(mb, "use_remove_padding", True) or not oa.get("pad_size"):
            return mi, oa
        ids = mi["input_ids"].clone()
        width = ids.shape[1]
        start = self.settings.sp_rank * width
        total = int(mb["input_ids"].offsets()[-1])
        tail = (torch.arange(width, device=ids.device) + start) >= total
        ids[0, tail] = 1
        return {**mi, "input_ids": ids}, oa


class _CuSeqlensInt64LM(impl.LMHeadEngine):
    """``cu_seqlens`` as int64 (verl's choice) instead of int32: the contract fixes no dtype."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if "cu_seqlens" in mi:
            mi = {**mi, "cu_seqlens": mi["cu_seqlens"].long(), "cu_seqlens_cpu": mi["cu_seqlens_cpu"].long()}
        return mi, oa


class _RowShapedOutputArgsLM(impl.LMHeadEngine):
    """A different, valid layout of the engine's private ``output_args``: the rolled labels and the
    per-token temperatures are kept as ``(1, n)`` rows (like the packed ids) instead of ``(n,)``.
    Only the engine's own ``prepare_model_outputs`` reads them, and it reads them back."""

    _ROWS = ("input_ids_rmpad_rolled", "temperature_rmpad")

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        return mi, {k: v.unsqueeze(0) if k in self._ROWS and isinstance(v, torch.Tensor) else v
                    for k, v in oa.items()}

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        flat = {k: v.reshape(-1) if k in self._ROWS and isinstance(v, torch.Tensor) else v for k, v in oa.items()}
        return super().prepare_model_outputs(output, flat, mb, logits_processor_func, **kw)


def _zeroed_at_ends(value: Any, ends: torch.Tensor) -> Any:
    """A nested per-token output with 0 written at each sequence's last token (values copied, offsets kept)."""
    if not (isinstance(value, torch.Tensor) and value.is_nested):
        return value
    values = value.values().clone()
    values[ends.to(values.device)] = 0
    return torch.nested.nested_tensor_from_jagged(values, value.offsets(), jagged_dim=getattr(value, "_ragged_idx", 1))


class _UnreadOutputsZeroedLM(impl.LMHeadEngine):
    """Every per-token output (log-probs, entropy, sum_pi_squared, distillation terms) holds 0 at each sequence's
    last token: that output scores no token of its sequence, every response slice stops before it, so no consumer
    reads it (the held-out verl change of issue 49 wrote 0 into the last token's entropy)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        ends = _sequence_ends(mb, mb["input_ids"].values().device)
        return {k: _zeroed_at_ends(v, ends) for k, v in out.items()}


@dataclass(frozen=True)
class Harmless:
    name: str
    lm: type
    what: str  # memory | unread value | layout

    @property
    def doc(self) -> str:
        return " ".join((self.lm.__doc__ or "").split())


HARMLESS: dict[str, Harmless] = {h.name: h for h in (
    Harmless("contiguous_copies", _ContiguousCopiesLM, "memory"),
    Harmless("per_sequence_labels", _PerSequenceLabelsLM, "unread value"),
    Harmless("last_label_pad", _LastLabelPadLM, "unread value"),
    Harmless("tail_pad_ids", _TailPadIdsLM, "unread value"),
    Harmless("cu_seqlens_int64", _CuSeqlensInt64LM, "layout"),
    Harmless("row_shaped_output_args", _RowShapedOutputArgsLM, "layout"),
    Harmless("unread_outputs_zeroed", _UnreadOutputsZeroedLM, "unread value"),
)}


class HarmlessEngine(ImplEngine):
    """impl with one harmless change (LM head; the value head is impl's)."""

    def __init__(self, entry: Harmless):
        self.entry = entry
        self.name = f"harmless:{entry.name}"
        self.engine_classes = {"lm": entry.lm, "value": impl.ValueHeadEngine}


def harmless_engine(name: str) -> HarmlessEngine:
    if name not in HARMLESS:
        raise ValueError(f"unknown harmless engine {name!r}; known: {sorted(HARMLESS)}")
    engine = HarmlessEngine(HARMLESS[name])
    engine.built_by = (harmless_engine, (name,))  # a rank process builds it by name
    return engine


# ``--engine spec.planted.harmless:<Name>`` (load_engine calls an EngineUnderTest subclass with no arguments)
class ContiguousCopies(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["contiguous_copies"])


class PerSequenceLabels(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["per_sequence_labels"])


class LastLabelPad(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["last_label_pad"])


class TailPadIds(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["tail_pad_ids"])


class CuSeqlensInt64(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["cu_seqlens_int64"])


class RowShapedOutputArgs(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["row_shaped_output_args"])


class UnreadOutputsZeroed(HarmlessEngine):
    def __init__(self) -> None:
        super().__init__(HARMLESS["unread_outputs_zeroed"])
