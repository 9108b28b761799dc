"""The checks of how an engine reads its flags and settings, stated once: the contract's flags and their defaults, their
other spellings, the wrong values and impossible settings tried, and the comparison of a run with the flags given to a
run with them left out or spelled otherwise. The invariants (spec/invariants/settings.py) call them on the suite's
runs; a standalone reproducer calls the same functions, vendored beside it (``repro_suite.py``;
spec/repro/runtime.py). So they take plain values (a micro-batch, what two runs handed over and returned) and fail
by :func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .failing import fail
from .state_checks import same

__all__ = ["FLAG_DEFAULTS", "BOOL_FLAGS", "BAD_FLAGS", "flag_value", "recode_flags", "bad_settings", "offered_settings",
           "SETTING_FEATURES", "same_run", "defaulted_flags", "slice_without_width", "slice_with_width"]

#: every per-batch flag of the contract with its default (pad_mode: NO_PADDING, compared by value)
FLAG_DEFAULTS: dict[str, Any] = {
    "use_remove_padding": True, "pad_mode": "no_padding", "use_fused_kernels": False, "pad_token_id": 0,
    "calculate_entropy": False, "calculate_sum_pi_squared": False, "distillation_use_topk": False,
    "distillation_only": False,
}
BOOL_FLAGS = tuple(k for k, v in FLAG_DEFAULTS.items() if isinstance(v, bool))


def _flag(mb: Any, key: str) -> Any:
    value = mb.get(key)
    return getattr(value, "data", value)


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # a str Enum (verl's DatasetPadMode) by its value


def _tensors(obj: Any, where: str) -> dict[str, Any]:
    """Every tensor (nested as values + offsets) and plain value of a dict or a namespace-like result."""
    items = obj.items() if isinstance(obj, dict) else vars(obj).items()
    out = {}
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[f"{where}[{key!r}]"] = (value.values().detach().cpu(), value.offsets().cpu())
        elif isinstance(value, torch.Tensor):
            out[f"{where}[{key!r}]"] = value.detach().cpu()
        else:
            out[f"{where}[{key!r}]"] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():  # NaN == NaN here: the padding of a model input may hold NaN in both runs
            return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        return torch.equal(a, b)
    if _plain_value(a) and _plain_value(b):
        return a == b
    # an engine's own object (an output_args entry the contract does not define): never compared with ``==`` or
    # ``bool()``, which an object holding tensors answers ambiguously; only its type is the suite's to compare
    return type(a) is type(b)


def _plain_value(value: Any) -> bool:
    """A value the suite can compare with ``==``: None, a bool, number, str, bytes, dtype or device, or a tuple or
    list of them (numpy scalars included)."""
    if isinstance(value, (tuple, list)):
        return all(_plain_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                               np.generic))


def flag_value(mb: Any, key: str) -> Any:
    """The plain value of flag ``key`` in the micro-batch ``mb`` (a str Enum by its value)."""
    return _plain(_flag(mb, key))


def same_run(got_inputs, got_args, got_outputs, want_inputs, want_args, want_outputs, what: str) -> None:
    """A run prepared the same model inputs and output_args (per rank) and returned the same outputs as another."""
    pairs = [(f"model_inputs of rank {r}", g, w) for r, (g, w) in enumerate(zip(got_inputs, want_inputs))]
    pairs += [(f"output_args of rank {r}", g, w) for r, (g, w) in enumerate(zip(got_args, want_args))]
    pairs.append(("outputs", got_outputs, want_outputs))
    for where, g, w in pairs:
        a, b = _tensors(g, where), _tensors(w, where)
        if set(a) != set(b):
            fail(f"{what}: {where} keys {sorted(a)}, expected {sorted(b)}")
        for key in a:
            if not _equal(a[key], b[key]):
                fail(f"{what}: {key} differs ({a[key]!r:.200} vs {b[key]!r:.200})")


def defaulted_flags(mb: Any, response_lens) -> list[str]:
    """INV-FLAG-001: the flags of ``mb`` at the contract's default (max_response_len at max(r_i)), those a run
    without them must match."""
    dropped = [key for key, default in FLAG_DEFAULTS.items() if key in mb.keys() and flag_value(mb, key) == default]
    if "max_response_len" in mb.keys() and flag_value(mb, "max_response_len") == max(response_lens):
        dropped.append("max_response_len")  # its default is max(r_i)
    return dropped


def slice_without_width(got, want) -> None:
    """INV-FLAG-001: no_padding_2_padding without max_response_len (``got``) as with it (``want``: the flag equalled
    max(r_i)). NaN equal to NaN in the same place: a NaN both give is the value checks'."""
    if not same(got, want):
        fail(f"no_padding_2_padding without max_response_len gave shape {tuple(got.shape)} "
             f"({'other values' if tuple(got.shape) == tuple(want.shape) else 'another shape'}), "
             f"expected {tuple(want.shape)} as with it (the flag equalled max(r_i))")


def slice_with_width(sliced, batch_size: int, width: int, written) -> None:
    """INV-FLAG-002: no_padding_2_padding with max_response_len spelled otherwise (``written``) is (B, width)."""
    if tuple(sliced.shape) != (batch_size, width):
        fail(f"no_padding_2_padding with max_response_len={written!r} gave shape "
             f"{tuple(sliced.shape)}, expected {(batch_size, width)}")


def recode_flags(mb: Any, style: int) -> dict[str, Any]:
    """Set every flag of ``mb`` to an equivalent spelling; return what was written.

    ``style`` 0: bools as 0/1 ints, pad_mode as a plain str; 1: numpy bools and numpy int64 ints."""
    written = {}
    for key in (*BOOL_FLAGS, "pad_token_id", "max_response_len", "pad_mode"):
        if key not in mb.keys():
            continue
        value = _plain(_flag(mb, key))
        if key == "pad_mode":
            new: Any = str(value)
        elif isinstance(value, bool):
            new = int(value) if style == 0 else np.bool_(value)
        else:
            new = int(value) if style == 0 else np.int64(value)
        mb.set_non_tensor(key, new)
        written[key] = new
    return written


#: every wrong-typed or impossible flag value INV-FLAG-003 hands an engine: each example tries all of them
BAD_FLAGS: tuple[tuple[str, Any], ...] = (
    *((key, bad) for key in BOOL_FLAGS for bad in ("False", 2, None)),
    ("pad_token_id", 1.5), ("pad_token_id", "0"), ("pad_token_id", True),
    ("max_response_len", 0), ("max_response_len", -1), ("max_response_len", 2.0),
)


#: the engine features whose settings INV-SET-001 tries, in order: sequence parallelism, the static bucket, chunking
SETTING_FEATURES = ("sp", "bucket", "chunking")


def offered_settings(engine: Any) -> tuple[str, ...]:
    """The features of :data:`SETTING_FEATURES` whose settings ``engine`` takes (``engine.lacks`` none)."""
    return tuple(feature for feature in SETTING_FEATURES if engine.lacks(feature) is None)


def bad_settings(case, offered: tuple[str, ...] = SETTING_FEATURES) -> tuple[dict[str, Any], ...]:
    """Every impossible engine setting INV-SET-001 tries (at the case's sp size, or 2) of the features ``offered``
    (of :data:`SETTING_FEATURES`: an engine is handed only settings it takes)."""
    sp = max(case.sp_size, 2)
    bad = {"sp": ({"sp_size": 0, "sp_rank": 0}, {"sp_size": sp, "sp_rank": sp}, {"sp_size": sp, "sp_rank": -1}),
           "bucket": ({"pad_to_length": 0}, {"pad_to_length": -8}),
           "chunking": ({"entropy_chunk_size": 0}, {"entropy_chunk_size": -1})}
    return tuple(setting for feature in SETTING_FEATURES if feature in offered for setting in bad[feature])
