"""A typed view of the flags a micro-batch carries as ``NonTensorData``.

The rule for reading a flag lives here once: a missing flag takes the contract's
default; a present one is unwrapped from ``NonTensorData`` and type-checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

from .errors import FlagTypeError, UnsupportedConfigError

__all__ = ["BatchFlags", "read_flag", "unwrap", "NO_PADDING"]

NO_PADDING = "no_padding"
_KNOWN_PAD_MODES = ("no_padding", "right", "left_right")


def read_flag(micro_batch: TensorDictBase, key: str, default: Any = None) -> Any:
    """The plain Python value stored under ``key``, or ``default`` if absent."""
    if key not in micro_batch.keys():
        return default
    return unwrap(micro_batch.get(key))


def unwrap(value: Any) -> Any:
    """The Python value a ``NonTensorData`` holds (``value`` itself for anything else).

    Reads the stored field directly: the tensorclass attribute ``.data`` costs ~3 us under
    tensordict 0.10 (seven flags a call add up on small batches).
    """
    if type(value).__name__ != "NonTensorData":
        return value
    try:
        return value._non_tensordict["data"]
    except (AttributeError, KeyError, TypeError):  # another tensordict's layout: the public attribute
        return value.data


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    # numpy/torch booleans and 0/1 ints are accepted; anything else is a typo.
    if type(value).__name__ in ("bool_", "bool") or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise FlagTypeError(f"flag {key!r} must be a bool, got {type(value).__name__} {value!r}")


def _as_int(key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and type(value).__name__ not in ("int64", "int32"):
        raise FlagTypeError(f"flag {key!r} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        raise FlagTypeError(f"flag {key!r} must be >= {minimum}, got {value}")
    return value


def _pad_mode(value: Any) -> str:
    # verl passes a ``str`` Enum; its value (or the string itself) is what counts.
    text = getattr(value, "value", value)
    if not isinstance(text, str):
        raise FlagTypeError(f"flag 'pad_mode' must be a str or str Enum, got {type(value).__name__}")
    if text not in _KNOWN_PAD_MODES:
        raise UnsupportedConfigError(
            f"flag 'pad_mode' is {text!r}; known modes are {_KNOWN_PAD_MODES}")
    if text != NO_PADDING:
        raise UnsupportedConfigError(
            f"flag 'pad_mode' is {text!r}; this engine accepts only {NO_PADDING!r} "
            "(convert dense batches with left_right_2_no_padding first)")
    return text


@dataclass(frozen=True)
class BatchFlags:
    """Every per-batch flag of the contract, with its default."""

    use_remove_padding: bool = True
    pad_mode: str = NO_PADDING
    use_fused_kernels: bool = False
    pad_token_id: int = 0
    calculate_entropy: bool = False
    calculate_sum_pi_squared: bool = False
    distillation_use_topk: bool = False
    distillation_only: bool = False
    max_response_len: int | None = None

    @classmethod
    def from_batch(cls, micro_batch: TensorDictBase) -> "BatchFlags":
        present = set(micro_batch.keys())  # one key listing; absent flags cost nothing

        def get(key: str, default: Any) -> Any:
            return unwrap(micro_batch.get(key)) if key in present else default
        max_len = get("max_response_len", None)
        if max_len is None:  # verl's spelling
            max_len = get("max_response_length", None)
        return cls(
            use_remove_padding=_as_bool("use_remove_padding", get("use_remove_padding", True)),
            pad_mode=_pad_mode(get("pad_mode", NO_PADDING)),
            use_fused_kernels=_as_bool("use_fused_kernels", get("use_fused_kernels", False)),
            pad_token_id=_as_int("pad_token_id", get("pad_token_id", 0), minimum=-(2**63)),
            calculate_entropy=_as_bool("calculate_entropy", get("calculate_entropy", False)),
            calculate_sum_pi_squared=_as_bool(
                "calculate_sum_pi_squared", get("calculate_sum_pi_squared", False)),
            distillation_use_topk=_as_bool("distillation_use_topk", get("distillation_use_topk", False)),
            distillation_only=_as_bool("distillation_only", get("distillation_only", False)),
            max_response_len=None if max_len is None else _as_int("max_response_len", max_len, minimum=1),
        )
