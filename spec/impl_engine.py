"""The project's own engine, as an engine under test."""

from __future__ import annotations

from typing import Any, Callable

import impl

from .engines import HELPERS, EngineUnderTest

__all__ = ["ImplEngine"]


class ImplEngine(EngineUnderTest):
    name = "impl"
    engine_classes = {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}
    #: impl's own gaps, found by the suite (each to be fixed in impl/, then removed here)
    known_failures = {
        "INV-DENSE-007": "left_right_2_no_padding carries MoE routed_experts over dense (B, S, ...) instead of "
                         "nesting the real tokens' rows as verl 0.9.1 does (impl/padding.py: convert it like the "
                         "teacher tensors)",
    }

    def make(self, head: str = "lm", **settings: Any) -> Any:
        return self.engine_classes[head](**settings)

    def helper(self, name: str) -> Callable | None:
        return getattr(impl, name) if name in HELPERS else None
