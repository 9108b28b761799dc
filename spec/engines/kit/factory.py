"""A user's engine from an import path: a factory, an engine class or an engine object."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from ...protocol.engine import EngineUnderTest, Feature, ReproSnippet
from ...protocol.vendor import source

__all__ = ["FactoryEngine", "engine_from_path"]

#: A setting the suite may ask for, and a value that probes whether an engine accepts it.
_FEATURE_PROBES = {
    Feature.SP: {"sp_size": 2, "sp_rank": 0, "all_gather": lambda local: local},
    Feature.BUCKET: {"pad_to_length": 8},
    Feature.CU_SEQLENS: {"pass_cu_seqlens": True},
    Feature.CHUNKING: {"entropy_chunk_size": 2},
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

    def lacks(self, feature: str | Feature) -> str | None:
        feature = Feature.parse(feature)
        probe = _FEATURE_PROBES.get(feature)
        if probe is not None or feature is Feature.VALUE:
            try:
                self.make("value") if feature is Feature.VALUE else self.make(**probe)
            except Exception as exc:  # noqa: BLE001 - any refusal means the feature is not offered
                return f"engine {self.name} cannot build {feature.value!r}: {type(exc).__name__}: {exc}"
            return None
        return super().lacks(feature)

    def repro_snippet(self, settings: Any) -> ReproSnippet | None:
        """A user's engine follows verl's calling convention by definition: the reproducer imports it from its own
        module and calls it as :meth:`make` does, with nothing of this suite (an engine object or class given as
        ``module:attr`` included)."""
        module, attr = (self.name.split(":", 1) + [""])[:2] if ":" in self.name else (None, None)
        if not module:
            return super().repro_snippet(settings)
        code = "\n".join(["import importlib", "", f"_MODULE = importlib.import_module({module!r})",
                           f"_TARGET = getattr(_MODULE, {attr!r})", "", source("spec.engines.kit.factory_repro")])
        return ReproSnippet(code, requires=module.split(".")[0])

    def helper(self, name: str) -> Callable | None:
        try:
            probe = self.make()
        except Exception:  # noqa: BLE001 - a factory that cannot build default engines has no helpers
            probe = None
        return getattr(probe, name, None) or getattr(self.module, name, None)


def engine_from_path(path: str) -> EngineUnderTest:
    """``module:attr``: an EngineUnderTest (subclass or instance), an engine class or object, or a factory."""
    module_name, attr = path.split(":", 1)
    module = importlib.import_module(module_name)
    target = getattr(module, attr)
    if isinstance(target, EngineUnderTest):
        return target
    if isinstance(target, type) and issubclass(target, EngineUnderTest):
        return target()
    if callable(target) or hasattr(target, "prepare_model_inputs"):
        engine = FactoryEngine(path, target, module)
        engine.built_by = (engine_from_path, (path,))  # its module does not pickle: a rank imports it again
        return engine
    raise TypeError(f"{path!r} is neither an EngineUnderTest, an engine class or object, nor a factory")

