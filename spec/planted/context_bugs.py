"""Quiet planted bugs that show in one autograd context only (``EngineCase.context``).

RL trainers call the same preparation in three contexts: the policy update (grad enabled, the logits require
grad) and the old-policy / reference log-prob passes (``torch.no_grad()`` or ``torch.inference_mode()``).
Each bug below is impl with one shortcut taken only in one of them; in the others it is impl.
"""

from __future__ import annotations

import torch

import impl
from impl.flags import read_flag

__all__ = ["InplaceDivWithoutGrad", "OutputsCachedInInferenceMode", "EntropyDetachedWithGrad"]


class InplaceDivWithoutGrad(impl.LMHeadEngine):
    """Without grad (an old-policy or reference pass) "no autograd graph to protect": the logits are divided by
    the temperature in place and impl then runs at T = 1. The model's logits come back changed (INV-MUT-002)
    whenever T != 1 and grad is off."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        logits = getattr(output, "logits", None)
        if torch.is_grad_enabled() or logits is None or read_flag(mb, "use_fused_kernels", False):
            return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        oa = dict(oa)
        key = "temperature_rmpad" if "temperature_rmpad" in oa else "temperature"
        temps = oa[key].to(logits.device).clamp(min=1e-8)
        shape = (1, -1, 1) if key == "temperature_rmpad" else (-1, 1, 1)
        logits.div_(temps.view(shape).to(logits.dtype))
        oa[key] = torch.ones_like(oa[key])
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class OutputsCachedInInferenceMode(impl.LMHeadEngine):
    """Under ``torch.inference_mode()`` (the reference pass, "the same batch comes back") the engine object
    memoises its outputs by the logits' shape: a later micro-batch of the same shape through the
    same engine object gets the earlier one's outputs (INV-BATCH-003)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        logits = getattr(output, "logits", None)
        if not torch.is_inference_mode_enabled() or logits is None:
            return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        key = tuple(logits.shape)
        cache = self.__dict__.setdefault("_cache", {})
        if key not in cache:
            cache[key] = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        return dict(cache[key])


class EntropyDetachedWithGrad(impl.LMHeadEngine):
    """With grad enabled (the policy update) the entropy is computed under ``torch.no_grad()`` "to save the
    activation memory of a metric": its value is right, but the entropy bonus of the policy loss gets no
    gradient (INV-GRAD-001)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if torch.is_grad_enabled() and "entropy" in out:
            out["entropy"] = out["entropy"].detach()
        return out
