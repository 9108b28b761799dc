"""Correct engines that declare what they are through their profile (spec.protocol.profile.EngineProfile), for
tests/test_profile.py (issue 35): each is impl where its profile says so, and refuses what its profile says it does
not take (so a case outside the profile shows as the engine's failure, never silently). The verdict must pass each.
Loadable as ``--engine tests.profile_engines:<Name>``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

import impl
from impl.flags import read_flag
from spec.engines.impl.adapter import ImplEngine
from spec.protocol import ConfigSwitch, EngineProfile, Feature, PaddedLayout
from spec.protocol.profile import token_columns

__all__ = ["PackedOnly", "PaddedOnly", "TextOnly", "MropeOnly", "LeftPadded", "WrongLeftDeclaredRight",
           "TailMultiple", "WrongTailUndeclared", "SwitchedTail", "WrongSwitchedTail", "Autocast", "Bf16UnderAutocast", "Bf16Undeclared"]

_MODULE = __name__


def _named(cls: type) -> type:
    cls.name = f"{_MODULE}:{cls.__name__}"
    return cls


def _refusing(base: type, refuse) -> type:
    """``base`` (an impl engine class) whose ``prepare_model_inputs`` raises what ``refuse(mb)`` returns."""
    class Refusing(base):
        def prepare_model_inputs(self, mb):
            why = refuse(mb)
            if why:
                raise NotImplementedError(why)
            return super().prepare_model_inputs(mb)
    Refusing.__name__ = f"Refusing{base.__name__}"
    return Refusing


def _classes(refuse) -> dict[str, type]:
    return {"lm": _refusing(impl.LMHeadEngine, refuse), "value": _refusing(impl.ValueHeadEngine, refuse)}


def _mrope(mb) -> bool:
    return mb["position_ids"].values().dim() == 2  # (4, total) per packed token: mRoPE


# -- modes ----------------------------------------------------------------------------------------------------------

@_named
class PackedOnly(ImplEngine):
    """impl that only packs (as a padding-free trainer's engine): the padded mode raises NotImplementedError."""

    profile = EngineProfile(modes=("packed",))
    engine_classes = _classes(lambda mb: not read_flag(mb, "use_remove_padding", True) and "packed only")


@_named
class PaddedOnly(ImplEngine):
    """impl that only runs padded rows: the packed mode raises NotImplementedError."""

    profile = EngineProfile(modes=("padded",))
    engine_classes = _classes(lambda mb: read_flag(mb, "use_remove_padding", True) and "padded only")


# -- positions ------------------------------------------------------------------------------------------------------

@_named
class TextOnly(ImplEngine):
    """A text-only engine: mRoPE (4, ...) positions raise."""

    profile = EngineProfile(positions=("rope",))
    engine_classes = _classes(lambda mb: _mrope(mb) and "text only: no mRoPE positions")


@_named
class MropeOnly(ImplEngine):
    """A vision-language engine: 2-D positions raise."""

    profile = EngineProfile(positions=("mrope",))
    engine_classes = _classes(lambda mb: not _mrope(mb) and "mRoPE positions only")


# -- the left layout: every row right-aligned -----------------------------------------------------------------------

def _moved(tensor: torch.Tensor, mb: Any, src: PaddedLayout, dst: PaddedLayout, fill, batch_dim: int = 0
           ) -> torch.Tensor:
    """A padded (..., B, L, ...) tensor with every token moved from its column in layout ``src`` to ``dst``."""
    seq = mb["input_ids"].offsets().diff()
    resp = mb["responses"].offsets().diff()
    rows, col_src, _ = token_columns(src, seq - resp, resp, tensor.device)
    _, col_dst, width = token_columns(dst, seq - resp, resp, tensor.device)
    moved = tensor.movedim((batch_dim, batch_dim + 1), (0, 1))
    out = moved.new_full((moved.shape[0], width, *moved.shape[2:]), fill)
    out[rows, col_dst] = moved[rows, col_src]
    return out.movedim((0, 1), (batch_dim, batch_dim + 1))


class _LeftLM(impl.LMHeadEngine):
    """impl whose padded model input has every row right-aligned (padding on the left, as SkyRL's and OpenRLHF's
    left-padded batches): its own right-padded input moved, and the model's output moved back before its step."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if mi.get("attention_mask") is None:  # packed: impl's own
            return mi, oa
        left, right = PaddedLayout.LEFT, PaddedLayout.RIGHT
        pos = mi["position_ids"]
        return {**mi, "input_ids": _moved(mi["input_ids"], mb, right, left, int(read_flag(mb, "pad_token_id", 0))),
                "position_ids": _moved(pos, mb, right, left, 0, batch_dim=1 if pos.dim() == 3 else 0),
                "attention_mask": _moved(mi["attention_mask"], mb, right, left, 0)}, oa

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        if "temperature_rmpad" in output_args:  # packed: impl's own
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)
        back = {k: _moved(v, mb, PaddedLayout.LEFT, PaddedLayout.RIGHT, 0) for k, v in vars(output).items()
                if isinstance(v, torch.Tensor)}
        return super().prepare_model_outputs(SimpleNamespace(**back), output_args, mb, logits_processor_func, **kw)


@_named
class LeftPadded(ImplEngine):
    """impl with left-padded (right-aligned) padded rows, declared as such."""

    profile = EngineProfile(padded_layouts=(PaddedLayout.LEFT,))
    engine_classes = {"lm": _LeftLM, "value": impl.ValueHeadEngine}

    def strategy_limits(self) -> dict[str, Any]:
        return {"allow_fused": False}  # fused kernels hand log_probs per column: not moved back here


@_named
class WrongLeftDeclaredRight(LeftPadded):
    """The left-padded engine declaring verl's right layout: the verdict must fail it."""

    profile = EngineProfile()


# -- tail padding to a multiple of N tokens -------------------------------------------------------------------------

TAIL = 16


@_named
class TailMultiple(ImplEngine):
    """impl whose packed row is always padded at its tail to a multiple of 16 tokens (a paged-attention block),
    declared as its profile's ``tail_multiple``; it has no bucket setting of its own."""

    profile = EngineProfile(tail_multiple=TAIL)

    def make(self, head: str = "lm", **settings: Any) -> Any:
        if settings.get("pad_to_length"):
            raise NotImplementedError("no static bucket: the tail rule is fixed")
        return super().make(head, **{**settings, "pad_to_length": TAIL})

    def lacks(self, feature: str | Feature) -> str | None:
        if Feature.parse(feature) is Feature.BUCKET:
            return f"{self.name}: no static bucket (its tail is always padded to a multiple of {TAIL})"
        if Feature.parse(feature) is Feature.DISTILLATION:
            return f"{self.name}: no top-K distillation (impl's bucket, which it pads with, refuses it)"
        return super().lacks(feature)


@_named
class WrongTailUndeclared(TailMultiple):
    """The tail-padding engine without its tail rule declared: its packed row is longer than the contract's."""

    profile = EngineProfile()


@_named
class SwitchedTail(TailMultiple):
    """impl whose packed row is padded at its tail to a multiple of 16 only where a switch of its configuration says so
    (as TRL's SFT ``pad_to_multiple_of``), declared as the switch's ``tail_multiple``."""

    profile = EngineProfile(config_space=(ConfigSwitch("pad_to_multiple_of", (None, TAIL), "the packed row padded at "
                                                       "its tail to this multiple", tail_multiple=True),))

    def make(self, head: str = "lm", pad_to_multiple_of: int | None = None, **settings: Any) -> Any:
        if pad_to_multiple_of is None:
            return ImplEngine.make(self, head, **settings)
        return ImplEngine.make(self, head, **{**settings, "pad_to_length": self.padded_to(pad_to_multiple_of)})

    def padded_to(self, multiple: int) -> int:
        return multiple


@_named
class WrongSwitchedTail(SwitchedTail):
    """The switched tail rule padding to half the multiple it is asked (a row of 8-token blocks for 16)."""

    def padded_to(self, multiple: int) -> int:
        return multiple // 2


# -- a caller's autocast --------------------------------------------------------------------------------------------

@_named
class Autocast(ImplEngine):
    """impl, whose callers also run it inside ``torch.autocast(dtype=torch.bfloat16)``."""

    profile = EngineProfile(contexts=("grad", "no_grad", "inference_mode", "autocast_bf16"))


def _bf16_logits(output: Any) -> Any:
    if not hasattr(output, "logits"):
        return output
    return SimpleNamespace(**{**vars(output), "logits": output.logits.to(torch.bfloat16).float()})


class _Bf16UnderAutocastLM(impl.LMHeadEngine):
    """impl whose output step, inside a caller's autocast, scales bfloat16 logits (it rounds the model's logits to
    bfloat16 first, as an engine whose scaling and log-softmax the autocast keeps in bfloat16 computes): bfloat16
    arithmetic on the scaled logits, which the autocast implies (spec.invariants.core.in_context)."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        output = _bf16_logits(output) if torch.is_autocast_enabled("cpu") else output
        return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)


class _Bf16AlwaysLM(impl.LMHeadEngine):
    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        return super().prepare_model_outputs(_bf16_logits(output), output_args, mb, logits_processor_func, **kw)


@_named
class Bf16UnderAutocast(ImplEngine):
    """Run by its callers only inside a bfloat16 autocast, where its scaled logits are bfloat16 numbers."""

    profile = EngineProfile(contexts=("autocast_bf16",))
    engine_classes = {"lm": _Bf16UnderAutocastLM, "value": impl.ValueHeadEngine}


@_named
class Bf16Undeclared(ImplEngine):
    """bfloat16 scaled logits with no autocast declared (nor a lower precision): the float32 budget rejects it."""

    engine_classes = {"lm": _Bf16AlwaysLM, "value": impl.ValueHeadEngine}


# -- refusals -------------------------------------------------------------------------------------------------------
def _nonpositive_temperature(mb) -> str | None:
    temperature = read_flag(mb, "temperature", 1.0)
    low = float(temperature.min()) if isinstance(temperature, torch.Tensor) else float(temperature)
    return f"temperature {low} <= 0" if low <= 0 else None


@_named
class RefusesNonpositiveTemperature(ImplEngine):
    """impl that raises for a temperature <= 0, and declares so (TRL's convention: no clamp)."""

    profile = replace(ImplEngine.profile, refuses={"temperature_nonpositive": "raises for T <= 0"})
    engine_classes = _classes(_nonpositive_temperature)


def _clamped(mb):
    """``mb`` with its temperature clamped below at 1e-8 (verl's convention), a shallow copy."""
    temperature, mb = read_flag(mb, "temperature", 1.0), mb.copy()
    if isinstance(temperature, torch.Tensor):
        mb["temperature"] = temperature.clamp(min=1e-8)
    else:
        mb.set_non_tensor("temperature", max(float(temperature), 1e-8))
    return mb


class _ClampingLM(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        return super().prepare_model_inputs(_clamped(mb))

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        return super().prepare_model_outputs(output, output_args, _clamped(mb), logits_processor_func)


@_named
class ClampsButDeclaresRefusal(ImplEngine):
    """impl clamping T at 1e-8 (verl's way: T = 0 gives finite outputs) yet declaring it refuses T <= 0: a wrong
    declaration."""

    profile = replace(ImplEngine.profile, refuses={"temperature_nonpositive": "claims to raise for T <= 0"})
    engine_classes = {"lm": _ClampingLM, "value": impl.ValueHeadEngine}
