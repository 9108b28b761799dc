"""Correct engines laid out differently from impl, for tests/test_false_alarms.py (issue 22's suite defects).

Each one differs from impl only where no consumer can tell, or in a layout it declares through the protocol;
the verdict must pass each. Loadable as ``--engine tests.false_alarm_engines:<Name>`` (the real-rank workers
rebuild them by that name). A ``Wrong*`` engine declares a layout it does not have: the verdict must fail it.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

import impl
from impl.flags import read_flag
from spec import protocol
from spec.engines.impl.adapter import ImplEngine

# The declarations are the protocol's str enums (spec.protocol.PaddedLayout, OutputSpan, HeadInput), written as their
# values so that this module also loads against a suite without them (tests/test_false_alarms.py then fails).
LEFT_RIGHT, RIGHT, RESPONSE, HIDDEN = "left_right", "right", "response", "hidden"

__all__ = ["LastTokenUnset", "OneTemperature", "Fp16NanAtClamp", "LeftRightPadded", "WrongLeftRightDeclaredRight",
           "WrongRightDeclaredLeftRight", "FusedHead", "LastLabelPadRanks", "ResponseOnly", "WrongShiftedResponses", "WrongFirstToken"]

_MODULE = __name__


def _named(cls: type) -> type:
    cls.name = f"{_MODULE}:{cls.__name__}"
    return cls


def _ends(mb: Any, device: torch.device) -> torch.Tensor:
    return mb["input_ids"].offsets()[1:].to(device) - 1


# -- 1: every per-token output left unset (NaN) at each sequence's last token (TRL's entropy[:, :-1]) -----------

def _unset_last(out: dict, mb: Any) -> dict:
    result = {}
    for key, value in out.items():
        values = value.values().clone()
        values[_ends(mb, values.device)] = float("nan")
        result[key] = torch.nested.nested_tensor_from_jagged(values, value.offsets())
    return result


class _LastTokenUnsetLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        return _unset_last(super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw), mb)


class _LastTokenUnsetValue(impl.ValueHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        return _unset_last(super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw), mb)


@_named
class LastTokenUnset(ImplEngine):
    """impl, but no output is computed at a sequence's last token (NaN there): a position no consumer reads."""

    engine_classes = {"lm": _LastTokenUnsetLM, "value": _LastTokenUnsetValue}


# -- 2: one temperature per trainer ---------------------------------------------------------------------------

class _OneTemperatureLM(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        if isinstance(read_flag(mb, "temperature", 1.0), torch.Tensor):
            raise TypeError("temperature: this engine takes one float per trainer, got a per-sample tensor")
        return super().prepare_model_inputs(mb)


@_named
class OneTemperature(ImplEngine):
    """impl that takes one temperature per trainer (TRL, OpenRLHF): a per-sample tensor is rejected."""

    engine_classes = {"lm": _OneTemperatureLM, "value": impl.ValueHeadEngine}
    profile = replace(ImplEngine.profile, per_sample_temperature=False)


# -- 3/4: a NaN the engine computes itself (fp16 logits at the 1e-8 clamp), the same in every run --------------

class _Fp16NanLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        if "log_probs" not in out or output.logits.dtype != torch.float16:
            return out
        temps = read_flag(mb, "temperature", 1.0)
        lens = mb["input_ids"].offsets().diff()
        temps = temps.float() if isinstance(temps, torch.Tensor) else torch.full((lens.shape[0],), float(temps))
        cold = torch.repeat_interleave(temps.to(lens.device) <= 1e-8, lens)  # as fp16 logits / 1e-8 overflow
        values = out["log_probs"].values().clone()
        values[cold.to(values.device)] = float("nan")
        return {**out, "log_probs": torch.nested.nested_tensor_from_jagged(values, out["log_probs"].offsets())}


@_named
class Fp16NanAtClamp(ImplEngine):
    """impl whose float16 path gives NaN log-probs for samples at T <= 1e-8 (one root cause, whatever the batch,
    padding or rank: the value invariants must report it, the run-vs-run and leak invariants must not)."""

    engine_classes = {"lm": _Fp16NanLM, "value": impl.ValueHeadEngine}


# -- 5: Hugging Face generate's padded layout: left-padded prompts, right-padded responses --------------------

def _columns(mb: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per token (sequence order): its sample, its right-padded column and its left-right column; the width."""
    seq = mb["input_ids"].offsets().diff().to(device)
    resp = mb["responses"].offsets().diff().to(device)
    prompts = seq - resp
    rows = torch.repeat_interleave(torch.arange(seq.shape[0], device=device), seq)
    right = torch.arange(int(seq.sum()), device=device) - (seq.cumsum(0) - seq)[rows]
    width = int(prompts.max())
    return rows, right, right + (width - prompts)[rows], width + int(resp.max())


def _relayout(tensor: torch.Tensor, rows, src, dst, width: int, fill, batch_dim: int = 0) -> torch.Tensor:
    """Move every token of a padded (..., B, L, ...) tensor from column ``src`` to column ``dst``."""
    moved = tensor.movedim((batch_dim, batch_dim + 1), (0, 1))
    out = moved.new_full((moved.shape[0], width, *moved.shape[2:]), fill)
    out[rows, dst] = moved[rows, src]
    return out.movedim((0, 1), (batch_dim, batch_dim + 1))


class _LeftRightLM(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)  # impl validates every flag; padded: verl's right layout
        if mi.get("attention_mask") is None:
            return mi, oa
        ids = mi["input_ids"]
        rows, right, left, width = _columns(mb, ids.device)
        pos = mi["position_ids"]
        lr = {"input_ids": _relayout(ids, rows, right, left, width, int(read_flag(mb, "pad_token_id", 0))),
              "position_ids": _relayout(pos, rows, right, left, width, 0, batch_dim=1 if pos.dim() == 3 else 0),
              "attention_mask": _relayout(mi["attention_mask"], rows, right, left, width, 0)}
        return {**mi, **lr}, oa

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        if "temperature_rmpad" in output_args:  # packed: impl's own
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        first = next(v for v in vars(output).values() if isinstance(v, torch.Tensor))
        rows, right, left, _ = _columns(mb, first.device)
        width = int(mb["input_ids"].offsets().diff().max())
        back = {k: _relayout(v, rows, left, right, width, 0) for k, v in vars(output).items()
                if isinstance(v, torch.Tensor)}
        return super().prepare_model_outputs(SimpleNamespace(**back), output_args, mb, logits_processor_func, **kw)


@_named
class LeftRightPadded(ImplEngine):
    """impl whose padded model input is laid out as Hugging Face ``generate`` returns it (TRL, OpenRLHF):
    prompts left-padded to the longest prompt, responses right-padded after it; declared as such."""

    engine_classes = {"lm": _LeftRightLM, "value": impl.ValueHeadEngine}
    padded_layout = LEFT_RIGHT

    def strategy_limits(self) -> dict[str, Any]:
        return {"allow_fused": False}


@_named
class WrongLeftRightDeclaredRight(LeftRightPadded):
    """The left-right engine declaring verl's right layout: what it hands the model is not what it declares."""

    padded_layout = RIGHT


@_named
class WrongRightDeclaredLeftRight(ImplEngine):
    """impl (verl's right layout) declaring the left-right layout."""

    padded_layout = LEFT_RIGHT


# -- 8: the fused-head protocol: log-probs from hidden states and the LM-head weight ---------------------------

class _FusedHeadLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        if hasattr(output, "log_probs"):  # fused kernels: the model hands log_probs itself
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        logits = output.hidden_states.float() @ output.lm_head_weight.float().T  # exact in float32
        rest = {k: v for k, v in vars(output).items() if k not in ("hidden_states", "lm_head_weight")}
        return super().prepare_model_outputs(SimpleNamespace(logits=logits, **rest), output_args, mb,
                                             logits_processor_func, **kw)


@_named
class FusedHead(ImplEngine):
    """impl computing its logits from the hidden states and the LM-head weight (TRL's add_fused_lm_head, Liger)."""

    engine_classes = {"lm": _FusedHeadLM, "value": impl.ValueHeadEngine}
    head_input = HIDDEN


# -- 9: the pad id as the label of each sequence's last token, on every rank (verl #6475, PR #6564) --------------

class _LastLabelPadLM(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        labels = oa["input_ids_rmpad_rolled"].clone()
        start = self.settings.sp_rank * labels.shape[0]  # this rank's slice of the global row
        local = _ends(mb, labels.device) - start
        local = local[(local >= 0) & (local < labels.shape[0])]
        labels[local] = int(read_flag(mb, "pad_token_id", 0))
        oa = {**oa, "input_ids_rmpad_rolled": labels}
        if "shift_labels" in mi:
            mi = {**mi, "shift_labels": labels.unsqueeze(0)}
        return mi, oa


@_named
class LastLabelPadRanks(ImplEngine):
    """impl labelling each sequence's last token with the pad id instead of the next sequence's first token, on one
    rank and on many: a label no response slice reads."""

    engine_classes = {"lm": _LastLabelPadLM, "value": impl.ValueHeadEngine}


# -- 10: outputs only where a response token is scored (TRL's logits_to_keep, OpenRLHF's action slice) ----------

class _ResponseOnlyLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        # what TRL/OpenRLHF compute: (B, R) completion log-probs; the protocol puts them back over the sequences
        return {key: protocol.sequences_from_responses(protocol.response_view(value, mb)[0], mb)
                for key, value in out.items()}


@_named
class ResponseOnly(ImplEngine):
    """impl returning its outputs only at the positions that score a response token (NaN elsewhere), declared."""

    engine_classes = {"lm": _ResponseOnlyLM, "value": impl.ValueHeadEngine}
    output_span = RESPONSE


class _ShiftedResponsesLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        result = {}
        for key, value in out.items():  # each output moved one position to the right: it scores the wrong token
            values = torch.cat([value.values()[:1], value.values()[:-1]])
            result[key] = torch.nested.nested_tensor_from_jagged(values, value.offsets())
        return result


@_named
class WrongShiftedResponses(ImplEngine):
    """A response-only engine reading its response slice one position late (TRL's logits_to_keep off by one)."""

    engine_classes = {"lm": _ShiftedResponsesLM, "value": impl.ValueHeadEngine}
    output_span = RESPONSE


class _WrongFirstTokenLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        result = {}
        for key, value in out.items():  # every output wrong at each sequence's first token
            values = value.values().clone()
            values[mb["input_ids"].offsets()[:-1].to(values.device)] += 1.0
            result[key] = torch.nested.nested_tensor_from_jagged(values, value.offsets())
        return result


@_named
class WrongFirstToken(ImplEngine):
    """impl with every output off by 1 at each sequence's first token (a position consumers read)."""

    engine_classes = {"lm": _WrongFirstTokenLM, "value": impl.ValueHeadEngine}
