"""Quiet planted bugs behind an engine's own configuration switch (``EngineUnderTest.config_space``), and one on a
declared lower-precision path (``EngineUnderTest.precision``).

Each engine declares the switch it adds (:data:`SWITCHES`); the strategies draw it like any other dimension, so
the bug runs only in the cases that draw the switch on. Off, the engine is impl.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import impl
from impl.flags import read_flag

from ..protocol.engine import ConfigSwitch, Precision
from ..truth.rules import padded_length
from .quiet_bugs import _OutputBug

__all__ = ["CheckpointedEntropyUntempered", "VocabChunkedLogsumexp", "TailMultipleOverPadded", "SWITCHES",
           "Bf16PathSkipsTemperature", "low_precision_log_probs"]


class _Switched(_OutputBug):
    """impl with one switch of its own (a keyword of the constructor, declared in :data:`SWITCHES`)."""

    switch = ""

    def __init__(self, **settings):
        self.on = settings.pop(self.switch, None)
        super().__init__(**settings)

    def redo(self, logits, temps, labels):
        return None if not self.on else self.switched(logits, temps, labels)


class CheckpointedEntropyUntempered(_Switched):
    """With ``entropy_checkpointing`` on (the entropy recomputed under torch.utils.checkpoint), the recompute
    function closes over the logits before the temperature was applied: the entropy is that of softmax(logits),
    not of softmax(logits / T). Shows with the switch on, entropy asked and T != 1 (INV-VAL-002)."""

    switch = "entropy_checkpointing"
    keys = ("entropy",)

    def switched(self, logits, temps, labels):
        lsm = torch.log_softmax(logits.float(), dim=-1)
        return {"entropy": -(lsm.exp() * lsm).sum(-1)}


class VocabChunkedLogsumexp(_Switched):
    """With ``vocab_chunk`` set, log-probs use a logsumexp accumulated over vocabulary chunks of that many ids
    (memory for 150k vocabularies), but the running sum is not rescaled when a later chunk raises the running
    max. Shows with the switch on and a later chunk holding a larger logit (V > chunk) (INV-VAL-001)."""

    switch = "vocab_chunk"

    def switched(self, logits, temps, labels):
        z = logits.float() / temps.clamp(min=1e-8).unsqueeze(-1)
        top = torch.full(z.shape[:1], -torch.inf, device=z.device)
        total = torch.zeros(z.shape[:1], device=z.device)
        for start in range(0, z.shape[-1], int(self.on)):
            part = z[:, start:start + int(self.on)]
            top = torch.maximum(top, part.amax(-1))
            total = total + (part - top.unsqueeze(-1)).exp().sum(-1)  # the earlier chunks' sum is not rescaled
        lse = top + total.log()
        return {"log_probs": z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - lse}


class TailMultipleOverPadded(impl.LMHeadEngine):
    """With ``pad_to_multiple_of`` set (a tail rule of its own, as TRL's SFT collator has), a packed row whose length
    is not a multiple already is padded by the multiple plus the remainder instead of the multiple minus it (TRL's
    ``pad``, Sub -> Add). The tail is padding as a bucket's is (impl pads to it): no output changes; the row's length
    is wrong. Shows with the switch on and the packed length not a multiple of it (INV-PAD-003)."""

    def __init__(self, *, pad_to_multiple_of: int | None = None, **settings):
        self.multiple = pad_to_multiple_of
        super().__init__(**settings)
        self.bucket = self.settings.pad_to_length

    def prepare_model_inputs(self, mb):
        length = self.bucket  # each micro-batch's own (an engine object kept across micro-batches starts afresh)
        # (impl's bucket, which pads it, refuses top-K distillation: such a micro-batch is left unpadded)
        if self.multiple and read_flag(mb, "use_remove_padding", True) and not read_flag(mb, "distillation_use_topk"):
            total = int(mb["input_ids"].values().shape[-1])
            base = padded_length(total, self.bucket, 1)
            remainder = base % self.multiple
            length = base + self.multiple + remainder if remainder else base  # the bug: multiple - remainder
        self.settings = replace(self.settings, pad_to_length=length)  # prepare_model_outputs reads the same
        return super().prepare_model_inputs(mb)


#: bug class -> the switch it declares
SWITCHES = {
    CheckpointedEntropyUntempered: ConfigSwitch(
        "entropy_checkpointing", (False, True), "the entropy recomputed under torch.utils.checkpoint"),
    VocabChunkedLogsumexp: ConfigSwitch(
        "vocab_chunk", (None, 4, 16), "log-probs from a logsumexp over vocabulary chunks of this many ids"),
    TailMultipleOverPadded: ConfigSwitch(
        "pad_to_multiple_of", (None, 8), "the packed row padded at its tail to a multiple of this many tokens",
        tail_multiple=True),
}


def low_precision_log_probs(key: str, case) -> "Precision":
    """verl's declaration for log_probs: computed from scaled logits in the logits' dtype (returned float32 here)."""
    low = getattr(case, "logits_dtype", "float32")
    if key != "log_probs" or low == "float32" or case.use_fused_kernels:
        return Precision()
    return Precision("float32", low)


class Bf16PathSkipsTemperature(_OutputBug):
    """Computes log-probs in the logits' own dtype, as verl does (declared: ``Precision("float32", dtype)``), but its
    bfloat16 fast path returns log_softmax(logits) without dividing by the temperature. Shows with bf16 logits and
    T != 1, beyond bf16's rounding: the declared precision does not hide it (INV-VAL-001)."""

    def redo(self, logits, temps, labels):
        if logits.dtype == torch.float32:
            return None
        z = logits if logits.dtype == torch.bfloat16 else logits / temps.clamp(min=1e-8).to(logits.dtype).unsqueeze(-1)
        lsm = torch.log_softmax(z, dim=-1)
        return {"log_probs": lsm.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1).float()}
