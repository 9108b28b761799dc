"""The engine registry: engine names -> engines under test, and ``module:attr`` loading.

The protocol (what an engine under test is) lives in :mod:`spec.protocol`; the adapters in
:mod:`spec.engines` and the planted bugs in :mod:`spec.planted`. This module imports them all, and
nothing imports it back except the faces (the CLI, the pytest plugin, fuzz, conftest): a rank process
rebuilds its engine from the engine's own recipe (:meth:`spec.protocol.EngineUnderTest.recipe`), not from
here. ``EngineUnderTest``, ``HELPERS`` and ``FactoryEngine`` are re-exported for code written against the
old single module.

A name a user types that names nothing (an engine, a planted bug, a hypothesis profile, an ``--only`` prefix
matching no invariant ID) raises :class:`UnknownName`, one line with the closest names ("did you mean"): the
command line turns it into a usage error (exit 2), the pytest plugin into a pytest usage error.

The verl adapters import verl (and, where verl imports them at module level, stub heavy
modules) only when one is built, so listing engines needs no verl.
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Callable, Iterable

from ..engines.automodel.adapter import AutomodelEngine
from ..engines.kit.factory import FactoryEngine, engine_from_path
from ..engines.impl.adapter import ImplEngine
from ..engines.megatron.adapter import MegatronEngine
from ..engines.openrlhf.adapter import OpenRLHFEngine
from ..engines.skyrl.adapter import SkyRLEngine, SkyRLTrainEngine
from ..engines.torchtitan.adapter import TorchTitanEngine
from ..engines.trl.adapter import TrlEngine
from ..engines.trl.fused import TrlFusedEngine
from ..engines.veomni.adapter import VeOmniEngine
from ..engines.verl.adapter import VerlEngine
from ..planted import PLANTED, planted_engine
from ..planted.harmless import HARMLESS, harmless_engine
from ..protocol.engine import HELPERS, EngineUnderTest
from ..protocol.errors import UnknownName
from .profiles import PROFILES, load_profile
from ..protocol.errors import InvalidRecord
from .runner import check_records

__all__ = ["EngineUnderTest", "FactoryEngine", "HELPERS", "ENGINES", "load_engine", "builtin_engine_names",
           "UnknownName", "did_you_mean", "check_prefixes", "checked_profile"]

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


def did_you_mean(word: str, choices: Iterable[str], *, n: int = 3) -> str:
    """``"; did you mean 'a' or 'b'?"`` with the choices closest to ``word`` (case ignored), or ``""``."""
    by_upper: dict[str, str] = {}
    for choice in choices:
        by_upper.setdefault(choice.upper(), choice)
    close = difflib.get_close_matches(word.upper(), list(by_upper), n=n, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(by_upper[c]) for c in close)}?" if close else ""


def _unknown_engine(spec: str) -> UnknownName:
    hint = did_you_mean(spec, builtin_engine_names()) or (
        ": a registered name (python -m spec engines), planted:<bug> (python -m spec engines --planted) "
        "or module:attr")
    return UnknownName(f"unknown engine {spec!r}{hint}")


def _check_module_attr(spec: str) -> None:
    """``module:attr`` whose module does not exist or lacks ``attr``: an :class:`UnknownName` (an error raised
    while the module itself is imported is the module's own and propagates as it is)."""
    module_name, attr = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise UnknownName(f"unknown engine {spec!r}: no module named {exc.name!r} on the path "
                              f"(a registered name: python -m spec engines)") from None
        raise
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        raise UnknownName(f"unknown engine {spec!r}: module {module_name!r} has no attribute {attr!r}"
                          + did_you_mean(attr, names))


def load_engine(spec: str) -> EngineUnderTest:
    """A registered name, ``planted:<bug>``, or ``module:attr`` (a factory, an engine class or object,
    or an EngineUnderTest). A name that names nothing raises :class:`UnknownName`; so does an engine with a
    known-failure record that could never match (``spec.run.runner.check_records``: a usage error, named before
    any example runs)."""
    engine = _load(spec)
    try:
        check_records(engine)
    except InvalidRecord as exc:
        raise UnknownName(str(exc)) from None
    return engine


def _load(spec: str) -> EngineUnderTest:
    if spec in ENGINES:
        return ENGINES[spec][0]()
    family, _, name = spec.partition(":")
    if family in ("harmless", "planted"):  # impl with a harmless difference (spec/planted/harmless.py) or a bug
        known = HARMLESS if family == "harmless" else PLANTED
        if name not in known:
            raise UnknownName(f"unknown {'harmless engine' if family == 'harmless' else 'planted bug'} {name!r}"
                              + (did_you_mean(name, known) or f" ({len(known)} known: python -m spec engines"
                                                                  f"{' --planted' if family == 'planted' else ''})"))
        return harmless_engine(name) if family == "harmless" else planted_engine(name)
    if ":" not in spec:
        raise _unknown_engine(spec)
    _check_module_attr(spec)
    return engine_from_path(spec)


def check_prefixes(prefixes: Iterable[str], ids: Iterable[str]) -> None:
    """Every ``--only`` prefix matches some invariant ID, else :class:`UnknownName` naming the first that does
    not, with the closest IDs and families."""
    ids = sorted(set(ids))
    for prefix in prefixes:
        if not any(i.startswith(prefix) for i in ids):
            families = sorted({i.rsplit("-", 1)[0] for i in ids})
            raise UnknownName(f"--only {prefix!r} matches no invariant ID"
                              + (did_you_mean(prefix, families + ids) or " (python -m spec list lists them)"))


def checked_profile(name: str | None) -> str:
    """:func:`spec.run.profiles.load_profile`, an unknown profile (named or from ``$HYPOTHESIS_PROFILE``) as
    :class:`UnknownName`."""
    chosen = name or os.environ.get("HYPOTHESIS_PROFILE")
    if chosen and chosen not in PROFILES:
        source = "" if name else " ($HYPOTHESIS_PROFILE)"
        raise UnknownName(f"unknown hypothesis profile {chosen!r}{source}"
                          + (did_you_mean(chosen, PROFILES) or f"; choose from {', '.join(PROFILES)}"))
    return load_profile(name)
