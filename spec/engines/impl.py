"""The project's own engine, as an engine under test."""

from __future__ import annotations

from typing import Any, Callable

import impl

from ..protocol.engine import HELPERS, EngineUnderTest

__all__ = ["ImplEngine"]


class ImplEngine(EngineUnderTest):
    name = "impl"
    engine_classes = {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}
    def make(self, head: str = "lm", **settings: Any) -> Any:
        return self.engine_classes[head](**settings)

    def helper(self, name: str) -> Callable | None:
        return getattr(impl, name) if name in HELPERS else None
