"""Every exception impl raises.

One base class, :class:`PrepError`; each subclass also derives from the built-in
exception a caller would expect (``ValueError`` or ``TypeError``), so
``except ValueError`` keeps working for code that does not know this package.
Messages name the offending key and the shapes involved.
"""

from __future__ import annotations

__all__ = [
    "PrepError",
    "NestedLayoutError",
    "BatchMismatchError",
    "ShapeError",
    "TemperatureError",
    "UnsupportedConfigError",
    "FlagTypeError",
    "LayoutWarning",
]


class PrepError(Exception):
    """Base class of every error raised by impl."""


class NestedLayoutError(PrepError, TypeError):
    """A key that must be a jagged nested tensor is not one, or is malformed."""


class BatchMismatchError(PrepError, ValueError):
    """Keys of one micro-batch disagree on the batch size or the sequence lengths."""


class ShapeError(PrepError, ValueError):
    """A tensor has the wrong shape, length or vocabulary for the mode."""


class TemperatureError(PrepError, ValueError):
    """Temperature of the wrong shape, or not finite and positive."""


class UnsupportedConfigError(PrepError, ValueError):
    """A combination of flags and engine settings the contract forbids."""


class FlagTypeError(PrepError, TypeError):
    """A micro-batch flag holds a value of the wrong type."""


class LayoutWarning(UserWarning):
    """A dense batch whose result is well defined for verl's keys but guessed or trimmed for impl's.

    ``left_right_2_no_padding(data)`` warns (and ``strict=True`` raises instead) when the
    prompt/response split is read from columns that do not hold a left-right layout, or when
    ``response_mask`` marks tokens that are not response tokens."""
