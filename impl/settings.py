"""Engine settings: what is fixed for an engine, not carried by each micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import UnsupportedConfigError

__all__ = ["EngineSettings"]


@dataclass(frozen=True)
class EngineSettings:
    """``sp_size``/``sp_rank``: Ulysses sequence parallelism (this rank's slice).
    ``pad_to_length``: static bucket for the packed length (None = off).
    ``pass_cu_seqlens``: add ``cu_seqlens`` to the packed model inputs.
    ``entropy_chunk_size``: rows per chunk for log-prob/entropy temporaries (None = all).
    ``all_gather``: concatenates ranks' per-token outputs along dim 0 (needed when sp_size > 1).
    """

    sp_size: int = 1
    sp_rank: int = 0
    pad_to_length: int | None = None
    pass_cu_seqlens: bool = False
    entropy_chunk_size: int | None = None
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sp_size, int) or self.sp_size < 1:
            raise UnsupportedConfigError(f"sp_size must be an int >= 1, got {self.sp_size!r}")
        if not isinstance(self.sp_rank, int) or not 0 <= self.sp_rank < self.sp_size:
            raise UnsupportedConfigError(f"sp_rank must be in [0, {self.sp_size}), got {self.sp_rank!r}")
        if self.pad_to_length is not None and (not isinstance(self.pad_to_length, int) or self.pad_to_length < 1):
            raise UnsupportedConfigError(f"pad_to_length must be None or an int >= 1, got {self.pad_to_length!r}")
        if self.entropy_chunk_size is not None and self.entropy_chunk_size < 1:
            raise UnsupportedConfigError(f"entropy_chunk_size must be None or >= 1, got {self.entropy_chunk_size!r}")
