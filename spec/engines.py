"""Engines under test: impl, planted bugs, verl, or a user's engine from an import path.

An engine under test builds engine objects with verl's two methods
(``prepare_model_inputs``, ``prepare_model_outputs``) for given settings, and offers
the padding helpers it ships. What it lacks is reported, so the invariants that need
it are skipped with that reason, never passed.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


__all__ = ["EngineUnderTest", "FactoryEngine", "HELPERS", "load_engine", "builtin_engine_names"]

HELPERS = ("build_attention_mask_from_nested", "no_padding_2_padding", "left_right_2_no_padding",
           "response_from_nested", "response_to_nested")


class EngineUnderTest:
    """Base class. Subclasses implement :meth:`make` and may override the rest."""

    name = "engine"
    #: spec.known.KnownFailure records: where a documented failure applies and how it fails (reported, not hidden)
    known_failures: tuple = ()

    def make(self, head: str = "lm", **settings: Any) -> Any:
        """An engine object; settings: sp_size, sp_rank, pad_to_length, all_gather."""
        raise NotImplementedError

    def helper(self, name: str) -> Callable | None:
        return None

    def strategy_limits(self) -> dict[str, Any]:
        """Strategy keyword arguments that keep drawn cases within what the engine supports."""
        return {}

    def lacks(self, feature: str) -> str | None:
        """Why the engine cannot run invariants needing ``feature`` (``sp``, ``bucket``, ``cu_seqlens``,
        ``chunking``, ``value``, ``fused``, ``distillation``, ``cuda`` or a helper name), or None."""
        if feature in HELPERS:
            return None if self.helper(feature) is not None else f"engine {self.name} ships no {feature}"
        if feature == "cuda":
            import torch

            return None if torch.cuda.is_available() else "no CUDA device"
        return None

    def __repr__(self) -> str:
        return f"<engine {self.name}>"


#: A setting the suite may ask for, and a value that probes whether an engine accepts it.
_FEATURE_PROBES = {
    "sp": {"sp_size": 2, "sp_rank": 0, "all_gather": lambda local: local},
    "bucket": {"pad_to_length": 8},
    "cu_seqlens": {"pass_cu_seqlens": True},
    "chunking": {"entropy_chunk_size": 2},
}


class FactoryEngine(EngineUnderTest):
    """A user's engine: a factory ``factory(head="lm"|"value", **settings) -> engine object``.

    Also accepted in its place: an engine *class* (built as ``cls(**settings)``, LM head only)
    or an engine *object* (used as is, no settings). A feature whose settings the factory
    rejects, or a head it cannot build, is reported as lacking (skipped, with the reason).
    Helpers are looked up on the engine object, then on the factory's module.
    """

    def __init__(self, name: str, factory: Callable[..., Any], module: Any = None):
        self.name = name
        self.factory = factory
        self.module = module

    def make(self, head: str = "lm", **settings: Any) -> Any:
        target = self.factory
        if hasattr(target, "prepare_model_inputs") and not isinstance(target, type):  # an engine object
            if settings or head != "lm":
                raise TypeError(f"{self.name} is one engine object: it takes no settings and has an LM head only")
            return target
        if isinstance(target, type):  # an engine class
            if head != "lm":
                raise TypeError(f"{self.name} is one engine class: it has an LM head only")
            return target(**settings)
        return target(head=head, **settings)

    def lacks(self, feature: str) -> str | None:
        probe = _FEATURE_PROBES.get(feature)
        if probe is not None or feature == "value":
            try:
                self.make("value") if feature == "value" else self.make(**probe)
            except Exception as exc:  # noqa: BLE001 - any refusal means the feature is not offered
                return f"engine {self.name} cannot build {feature!r}: {type(exc).__name__}: {exc}"
            return None
        return super().lacks(feature)

    def helper(self, name: str) -> Callable | None:
        try:
            probe = self.make()
        except Exception:  # noqa: BLE001 - a factory that cannot build default engines has no helpers
            probe = None
        return getattr(probe, name, None) or getattr(self.module, name, None)


def _impl() -> EngineUnderTest:
    from .impl_engine import ImplEngine

    return ImplEngine()


def _verl() -> EngineUnderTest:
    from .verl_engine import VerlEngine

    return VerlEngine()


def builtin_engine_names() -> list[str]:
    from .planted import PLANTED

    return ["impl", "verl"] + [f"planted:{name}" for name in PLANTED]


def load_engine(spec: str) -> EngineUnderTest:
    """``impl``, ``verl``, ``planted:<bug>``, or ``module:attr`` (a factory, an engine class or
    object, or an EngineUnderTest)."""
    if spec == "impl":
        return _impl()
    if spec == "verl":
        return _verl()
    if spec.startswith("planted:"):
        from .planted import planted_engine

        return planted_engine(spec.split(":", 1)[1])
    if ":" not in spec:
        raise ValueError(f"unknown engine {spec!r}: use one of {builtin_engine_names()} or module:attr")
    module_name, attr = spec.split(":", 1)
    module = importlib.import_module(module_name)
    target = getattr(module, attr)
    if isinstance(target, EngineUnderTest):
        return target
    if isinstance(target, type) and issubclass(target, EngineUnderTest):
        return target()
    if callable(target) or hasattr(target, "prepare_model_inputs"):
        return FactoryEngine(spec, target, module)
    raise TypeError(f"{spec!r} is neither an EngineUnderTest, an engine class or object, nor a factory")

