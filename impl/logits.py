"""Per-token quantities computed from logits, and the temperature rule.

Everything here works on *packed rows*: ``logits`` of shape ``(N, V)`` for the N
real tokens of a batch (the caller selects them first). Results are float32
whatever the logits' dtype.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

import torch

from .errors import TemperatureError

__all__ = [
    "TEMPERATURE_FLOOR",
    "logprobs_from_logits",
    "entropy_from_logits",
    "sum_pi_squared_from_logits",
    "token_statistics",
    "sample_temperature",
    "scalar_temperature",
]

TEMPERATURE_FLOOR = 1e-8


def _statistics(scaled: torch.Tensor, labels: torch.Tensor | None, *, entropy: bool,
                sum_pi_squared: bool) -> dict[str, torch.Tensor]:
    """The per-token math, once, over the last dim of float32 ``scaled`` logits ``(..., V)``."""
    out: dict[str, torch.Tensor] = {}
    if not (entropy or sum_pi_squared):
        if labels is not None:
            lse = torch.logsumexp(scaled, dim=-1)
            out["log_probs"] = scaled.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1) - lse
        return out
    # One exp pass serves every quantity: with m the row max, z = x - m <= 0, e = exp(z), s = sum(e):
    # lse = log s + m (torch.logsumexp's own formula, so log_probs match the path above bit for bit),
    # entropy = log s - sum(e * z) / s (two non-negative terms: no cancellation at low temperature,
    # unlike lse - sum(p * x)), sum_pi_squared = sum(e * e) / s^2.
    top = scaled.amax(dim=-1, keepdim=True)
    shifted = scaled - top
    e = shifted.exp()
    total = e.sum(-1)
    log_total = total.log()
    if labels is not None:
        lse = log_total + top.squeeze(-1)
        out["log_probs"] = scaled.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1) - lse
    if entropy:
        out["entropy"] = log_total - (e * shifted).sum(-1) / total  # a summed product: BLAS dots lose ~1e-5
    if sum_pi_squared:
        out["sum_pi_squared"] = (e * e).sum(-1) / (total * total)
    return out


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[label]`` along the last dim, float32, shape ``labels.shape``."""
    return _statistics(logits.float(), labels, entropy=False, sum_pi_squared=False)["log_probs"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` along the last dim, float32."""
    return _statistics(logits.float(), None, entropy=True, sum_pi_squared=False)["entropy"]


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``sum(softmax(logits) ** 2)`` along the last dim, float32."""
    return _statistics(logits.float(), None, entropy=False, sum_pi_squared=True)["sum_pi_squared"]


#: Target size of one chunk of float32 logits rows: small enough that a chunk and its float32
#: temporaries stay in cache between the passes (amax, sub, exp, sum, products). Measured on the
#: benchmark's packed rows (B=8, V=32768, 1 thread): 1 MiB chunks 95-120 ms vs 4 MiB 122-203 ms
#: (entropy off / on, f32 and bf16), equal at V=2048; 512 KiB and 256 KiB were slower again.
CHUNK_BYTES = 1 << 20


def _chunk_bounds(total: int, size: int) -> list[tuple[int, int]]:
    starts = list(range(0, total, size)) or [0]
    return list(itertools.pairwise(starts + [total]))


def token_statistics(rows: Callable[[int, int], torch.Tensor], total: int, vocab: int,
                     labels: torch.Tensor | None, *, entropy: bool, sum_pi_squared: bool,
                     chunk_size: int | None = None) -> dict[str, torch.Tensor]:
    """``log_probs`` (when ``labels`` is given), ``entropy`` and ``sum_pi_squared``, each ``(total,)`` float32.

    ``rows(start, stop)`` returns the temperature-scaled float32 logits ``(stop - start, V)`` of
    those tokens. Rows are processed in chunks of ``chunk_size`` (default: about
    :data:`CHUNK_BYTES` of logits), so the temporaries never exceed one chunk.
    """
    size = chunk_size or max(1, CHUNK_BYTES // (4 * max(vocab, 1)))
    wanted = (["log_probs"] if labels is not None else []) + (["entropy"] if entropy else []) + (
        ["sum_pi_squared"] if sum_pi_squared else [])
    if not wanted:
        return {}
    out: dict[str, torch.Tensor] = {}
    # A loop over token chunks (not over sequences): bounded memory for any batch.
    for start, stop in _chunk_bounds(total, size):
        scaled = rows(start, stop)
        part = _statistics(scaled, None if labels is None else labels[start:stop], entropy=entropy,
                           sum_pi_squared=sum_pi_squared)
        if not out:
            out = {key: scaled.new_empty(total, dtype=torch.float32) for key in wanted}
        for key, value in part.items():
            out[key][start:stop] = value
    return out


def scalar_temperature(value: Any) -> float | None:
    """The temperature as one float when it is a single value, else ``None``."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and value.dim() == 0 else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def sample_temperature(value: Any, batch_size: int, device: torch.device) -> torch.Tensor:
    """``(B,)`` float32 per-sample temperatures from a float or a ``(B,)`` tensor; checked."""
    if value is None:
        raise TemperatureError("micro-batch has no 'temperature' (a float or a (B,) tensor)")
    scalar = scalar_temperature(value)
    if scalar is not None:
        temps = torch.full((batch_size,), scalar, dtype=torch.float32, device=device)
    elif isinstance(value, torch.Tensor):
        if value.is_nested or value.dim() != 1 or value.shape[0] != batch_size:
            raise TemperatureError(
                f"'temperature' must be a float or a ({batch_size},) tensor, got shape "
                f"{tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TemperatureError(f"'temperature' must be real-valued, got {value.dtype}")
        temps = value.to(device=device, dtype=torch.float32)
    else:
        raise TemperatureError(f"'temperature' must be a float or a tensor, got {type(value).__name__}")
    lo, hi = torch.stack(temps.aminmax()).tolist()  # NaN propagates into both
    if not (lo > 0 and hi < math.inf):
        raise TemperatureError(f"'temperature' must be finite and > 0, got {temps.tolist()}")
    return temps
