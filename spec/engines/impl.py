"""The project's own engine, as an engine under test."""

from __future__ import annotations

from typing import Any, Callable

import impl

from ..protocol.engine import HELPERS, ConfigSwitch, EngineUnderTest

__all__ = ["ImplEngine"]


class ImplEngine(EngineUnderTest):
    name = "impl"
    engine_classes = {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}
    def make(self, head: str = "lm", **settings: Any) -> Any:
        return self.engine_classes[head](**settings)

    def helper(self, name: str) -> Callable | None:
        return getattr(impl, name) if name in HELPERS else None

    def config_space(self) -> tuple[ConfigSwitch, ...]:
        """impl's settings that change its preparation's path (``impl.EngineSettings``), each drawn as the suite's
        setting of that name."""
        return (
            ConfigSwitch("entropy_chunk_size", setting="entropy_chunk_size", needs=("chunking",),
                         text="rows per chunk of the log-prob/entropy temporaries (None: about 1 MiB of float32 "
                              "logits, impl.logits.CHUNK_BYTES)"),
            ConfigSwitch("pad_to_length", setting="pad_to_length", needs=("bucket",),
                         text="the static bucket of the packed length"),
            ConfigSwitch("pass_cu_seqlens", setting="pass_cu_seqlens", needs=("cu_seqlens",),
                         text="cu_seqlens in the packed model inputs"),
        )
