"""An engine's profile: everything the suite may assume about one engine, declared in one record.

PyTorch's OpInfo keeps everything about an op in one record; an engine's :class:`EngineProfile` does the same
for an engine under test (``EngineUnderTest.profile``):

* ``modes``: the modes it runs (``"packed"``, ``"padded"``); a target of a mode it does not run is a skip with
  the profile's reason, never the engine's failure;
* ``padded_layouts``: where each padded row's tokens sit (:class:`~spec.protocol.engine.PaddedLayout`);
* ``positions``: the position kinds it accepts (``"rope"``: ``(B, n)``; ``"mrope"``: ``(B, 4, n)``);
* ``tail_multiple``: the packed row is padded at its tail to a multiple of this many tokens (None: no rule);
* ``contexts``: the execution contexts its callers run the preparation in (autograd modes, autocast);
* ``conventions``: what the engine promises beyond the contract (:class:`Convention`): checked for this engine
  only, never asserted of an engine that does not declare it;
* ``surface``: the engine's own preparation code (``package.module`` or ``package.module:function``), whose
  lines and branches ``spec verify`` measures with coverage.py;
* ``unreachable``: branches of the surface no CPU run can reach, each with its reason (``"module:line"`` ->
  ``"needs CUDA"``).

This module imports nothing from ``spec`` (tests/test_layering.py): the protocol layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

__all__ = ["Convention", "EngineProfile", "DEFAULT_PROFILE", "MODES", "POSITIONS", "VERL_CONVENTIONS"]

#: the two ways a trainer feeds the model
MODES = ("packed", "padded")
#: the position kinds: 1-D rotary positions, or Qwen2-VL's 4-axis mRoPE positions
POSITIONS = ("rope", "mrope")


class Convention(str, Enum):
    """What one engine promises beyond the contract (docs/contract.md, "Conventions"). The contract asserts what
    every consumer reads; a convention is asserted only of an engine whose profile declares it."""

    #: the padded ``attention_mask`` is int32 (verl); the contract asks only for 0/1 values of an integer or bool dtype
    INT32_ATTENTION_MASK = "int32_attention_mask"
    #: padding columns of ``position_ids`` hold 0 (verl); the contract leaves them to the engine (no consumer reads them)
    PADDING_POSITION_ZERO = "padding_position_zero"
    #: the packed boundaries are also handed as a host copy, ``cu_seqlens_cpu`` (verl)
    CU_SEQLENS_HOST_COPY = "cu_seqlens_host_copy"
    #: the model's logits are left as they were, even where no caller reads them again (verl); the contract only
    #: forbids changing what a caller still reads (its micro-batch, its own tensors)
    LOGITS_UNTOUCHED = "logits_untouched"


#: what verl's FSDP engine (and impl, its drop-in) promises beyond the contract: all four conventions
VERL_CONVENTIONS: frozenset[Convention] = frozenset(Convention)


@dataclass(frozen=True)
class EngineProfile:
    """What one engine is (see the module docstring). The default is verl's FSDP engine without its conventions:
    both modes, right-aligned padded rows, both position kinds, no tail rule, every autograd context."""

    modes: tuple[str, ...] = MODES
    padded_layouts: tuple[str, ...] = ("right",)
    positions: tuple[str, ...] = POSITIONS
    tail_multiple: int | None = None
    contexts: tuple[str, ...] = ("grad", "no_grad", "inference_mode")
    conventions: frozenset[Convention] = frozenset()
    surface: tuple[str, ...] = ()
    unreachable: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"profile modes: unknown mode {mode!r}; modes: {MODES}")
        if not self.modes:
            raise ValueError("profile modes: an engine runs at least one mode")
        for kind in self.positions:
            if kind not in POSITIONS:
                raise ValueError(f"profile positions: unknown kind {kind!r}; kinds: {POSITIONS}")
        if self.tail_multiple is not None and self.tail_multiple < 1:
            raise ValueError(f"profile tail_multiple must be >= 1 or None, got {self.tail_multiple!r}")
        object.__setattr__(self, "conventions", frozenset(Convention(c) for c in self.conventions))

    def runs(self, mode: str) -> bool:
        return mode in self.modes

    def promises(self, convention: "Convention | str") -> bool:
        return Convention(convention) in self.conventions


DEFAULT_PROFILE = EngineProfile()
