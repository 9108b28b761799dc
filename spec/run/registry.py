"""The engine registry: engine names -> engines under test, and ``module:attr`` loading.

The protocol (what an engine under test is) lives in :mod:`spec.protocol`; the adapters in
:mod:`spec.engines` and the planted bugs in :mod:`spec.planted`. This module imports them all, and
nothing imports it back except the faces (the CLI, the pytest plugin, fuzz, conftest): a rank process
rebuilds its engine from the engine's own recipe (:meth:`spec.protocol.EngineUnderTest.recipe`), not from
here. ``EngineUnderTest``, ``HELPERS`` and ``FactoryEngine`` are re-exported for code written against the
old single module.

The verl adapters import verl (and, where verl imports them at module level, stub heavy
modules) only when one is built, so listing engines needs no verl.
"""

from __future__ import annotations

from typing import Callable

from ..engines.automodel import AutomodelEngine
from ..engines.factory import FactoryEngine, engine_from_path
from ..engines.impl import ImplEngine
from ..engines.megatron import MegatronEngine
from ..engines.openrlhf import OpenRLHFEngine
from ..engines.skyrl import SkyRLEngine, SkyRLTrainEngine
from ..engines.torchtitan import TorchTitanEngine
from ..engines.trl import TrlEngine, TrlFusedEngine
from ..engines.veomni import VeOmniEngine
from ..engines.verl import VerlEngine
from ..planted import PLANTED, planted_engine
from ..planted.harmless import harmless_engine
from ..protocol.engine import HELPERS, EngineUnderTest

__all__ = ["EngineUnderTest", "FactoryEngine", "HELPERS", "ENGINES", "load_engine", "builtin_engine_names"]

#: name -> (constructor, one line: what it is)
ENGINES: dict[str, tuple[Callable[[], EngineUnderTest], str]] = {
    "impl": (ImplEngine, "this project's engine (impl/)"),
    "verl": (VerlEngine, "verl's FSDP engine (verl.workers.engine.fsdp); FSDP-Turbo inherits its preparation"),
    "verl-veomni": (VeOmniEngine, "verl's VeOmni engine (FSDP's preparation plus VeOmni's input transforms)"),
    "verl-torchtitan": (TorchTitanEngine, "verl's TorchTitan engine (its own prepare_model_inputs/outputs)"),
    "verl-automodel": (AutomodelEngine, "verl's Automodel (NeMo) engine (its own prepare_model_inputs/outputs)"),
    "verl-megatron": (MegatronEngine, "verl's Megatron packing (verl.models.mcore.util THD/BSHD engine "
                                      "pre/postprocess), MindSpeed inherits it"),
    "trl": (TrlEngine, "Hugging Face TRL 1.16's logits API (selective_log_softmax, entropy_from_logits) on its own "
                       "GRPO / padding-free batches"),
    "trl-fused": (TrlFusedEngine, "TRL 1.16's GRPO fused LM head (add_fused_lm_head, "
                                  "_get_per_token_logps_and_entropies)"),
    "openrlhf": (OpenRLHFEngine, "OpenRLHF 0.11.2's Actor.forward (packing, log-probs, entropy)"),
    "skyrl-train": (SkyRLTrainEngine, "skyrl-train 0.3.1's HFModelWrapper.forward on its own left-right padded batches"),
    "skyrl": (SkyRLEngine, "skyrl 0.4.0's HFModelWrapper.forward on its own left-padded batches"),
}


def builtin_engine_names() -> list[str]:
    return list(ENGINES) + [f"planted:{name}" for name in PLANTED]


def describe_engines() -> list[str]:
    """One line per registered engine, for ``python -m spec engines``."""
    return [f"{name:<16} {what}" for name, (_, what) in ENGINES.items()] + \
        [f"planted:<bug>    impl with one planted bug ({len(PLANTED)}: python -m spec engines --planted)"]


def load_engine(spec: str) -> EngineUnderTest:
    """A registered name, ``planted:<bug>``, or ``module:attr`` (a factory, an engine class or object,
    or an EngineUnderTest)."""
    if spec in ENGINES:
        return ENGINES[spec][0]()
    if spec.startswith("harmless:"):  # impl with a harmless difference (spec/planted/harmless.py)
        return harmless_engine(spec.split(":", 1)[1])
    if spec.startswith("planted:"):
        return planted_engine(spec.split(":", 1)[1])
    if ":" not in spec:
        raise ValueError(f"unknown engine {spec!r}: use one of {builtin_engine_names()} or module:attr")
    return engine_from_path(spec)
