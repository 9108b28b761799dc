"""The calling convention TRL and OpenRLHF share: per-sample tensors in, dense ``(B, L)`` outputs back out.

Both libraries take lists of per-sample token tensors (what ``generate`` or vLLM returns) and pad them with
their own functions. These helpers only split the suite's nested micro-batch into such lists (:func:`samples`)
and read the single float temperature both libraries take (:func:`one_temperature`); flags are read with the
contract's typed reader (``impl.flags.BatchFlags``).
"""

from __future__ import annotations

import torch

from impl.flags import BatchFlags, read_flag

__all__ = ["samples", "one_temperature", "BatchFlags", "OneTemperatureError"]


class OneTemperatureError(NotImplementedError):
    """The library takes one temperature per trainer; the micro-batch holds distinct per-sample ones."""


def samples(mb, key: str) -> list[torch.Tensor]:
    """``mb[key]`` as one tensor per sample (mRoPE positions ``(4, n_i)`` as ``(n_i, 4)``: libraries pad dim 0)."""
    nested = mb[key]
    return [t.transpose(0, 1) if t.dim() == 2 else t for t in nested.unbind()]


def one_temperature(mb) -> float:
    """The single float temperature (a ``(B,)`` tensor of equal values counts as one)."""
    value = read_flag(mb, "temperature", 1.0)
    if isinstance(value, torch.Tensor):
        if value.numel() and bool((value != value.reshape(-1)[0]).any()):
            raise OneTemperatureError(f"temperature: a per-sample (B,) tensor {value.tolist()}; this library "
                                      "takes one temperature per trainer (a float)")
        value = value.reshape(-1)[0].item() if value.numel() else 1.0
    return float(value)
