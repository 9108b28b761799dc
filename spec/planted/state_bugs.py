"""Planted bugs of an engine object kept across micro-batches: state from one call leaks into the next.

Each shows only when the same engine object has prepared another micro-batch before (what
``spec/invariants/state.py`` does); a fresh engine per call, as every other invariant builds, passes.
"""

from __future__ import annotations

import torch

import impl
from impl.flags import read_flag

__all__ = ["MaskCachedByShape", "LogProbsInReusedBuffer", "EntropyFlagReadOnce"]


class MaskCachedByShape(impl.LMHeadEngine):
    """The padded attention mask is cached by its (B, L) shape: stale when a micro-batch of the same shape
    but other lengths came before."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        mask = mi.get("attention_mask")
        if mask is not None:
            cache = self.__dict__.setdefault("_masks", {})
            mi["attention_mask"] = cache.setdefault((tuple(mask.shape), mask.device), mask)
        return mi, oa


class LogProbsInReusedBuffer(impl.LMHeadEngine):
    """log_probs are written into one buffer the engine keeps and reuses (grown only when too small): the next
    micro-batch of no more tokens overwrites the log-probs the trainer still holds."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
        log_probs = out.get("log_probs")
        if log_probs is not None and log_probs.is_nested:
            values = log_probs.values()
            buffer = self.__dict__.get("_buffer")
            if buffer is None or buffer.numel() < values.numel() or buffer.dtype != values.dtype \
                    or buffer.device != values.device:
                buffer = self._buffer = torch.empty_like(values)
            kept = buffer[: values.numel()].copy_(values)
            out["log_probs"] = torch.nested.nested_tensor_from_jagged(kept, log_probs.offsets())
        return out


class EntropyFlagReadOnce(impl.LMHeadEngine):
    """calculate_entropy is read from the first micro-batch and kept: later micro-batches that ask otherwise get
    the first one's answer."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        wanted = self.__dict__.setdefault("_entropy", bool(read_flag(mb, "calculate_entropy", False)))
        if wanted != bool(read_flag(mb, "calculate_entropy", False)):
            mb = mb.copy()  # a shallow copy: the trainer's micro-batch is untouched
            mb.set_non_tensor("calculate_entropy", wanted)
        return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
