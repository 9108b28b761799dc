"""The project's own engine, as an engine under test."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import impl
import impl.microbatch

from ..protocol.engine import HELPERS, ConfigSwitch, EngineUnderTest, ReproSnippet
from ..protocol.microbatch import MicroBatchLayer, layer_from
from ..protocol.profile import VERL_CONVENTIONS

__all__ = ["ImplEngine"]


class ImplEngine(EngineUnderTest):
    name = "impl"
    profile = replace(EngineUnderTest.profile, conventions=VERL_CONVENTIONS)  # a drop-in keeps verl's conventions
    engine_classes = {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}

    def make(self, head: str = "lm", **settings: Any) -> Any:
        return self.engine_classes[head](**settings)

    def helper(self, name: str) -> Callable | None:
        return getattr(impl, name) if name in HELPERS else None

    def microbatch_layer(self) -> MicroBatchLayer | None:
        """``impl.microbatch``: a drop-in with verl 0.9.1's names."""
        return layer_from("impl", [impl.microbatch])

    def repro_snippet(self, settings: Any) -> ReproSnippet | None:
        """impl's own entry points (a subclass with other engine classes, e.g. a planted bug, keeps the default)."""
        if type(self) is not ImplEngine:
            return super().repro_snippet(settings)
        return ReproSnippet(IMPL_SNIPPET, requires="rl-ioprep (this project's impl/)", standalone=True)

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


IMPL_SNIPPET = """import impl


def make_engine(head, **settings):
    return {"lm": impl.LMHeadEngine, "value": impl.ValueHeadEngine}[head](**settings)


def helper(name):
    return getattr(impl, name, None)
"""
