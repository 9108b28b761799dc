"""verl's VeOmni engines as an engine under test (``--engine verl-veomni``).

``verl.workers.engine.veomni.transformer_impl.VeOmniEngineWithLMHead`` / ``...WithValueHead`` inherit
FSDP's ``prepare_model_inputs`` / ``prepare_model_outputs`` and add their own input transforms
(``_apply_veomni_input_transforms``: varlen flash-attention kwargs from the packed position ids, the
VL image/video masks, VeOmni's sequence-parallel slicing; fused kernels: ``labels``/``shift_labels``/
``return_log_probs``; router replay). The object is built without its constructor, exactly like the
FSDP adapter (:class:`spec.engines.verl.adapter.VerlEngine`, reused here); the extra attributes VeOmni reads
are set to "off": ``_router_replay = None`` (R3 router replay where its switch is drawn:
:mod:`spec.engines.veomni.router_replay`), a model type that is not a VL type (a media micro-batch's is one:
:mod:`spec.engines.veomni.media`).

``veomni`` itself installs CPU-only from the package index (``pip install --no-deps veomni``); when it
does not import, its module-level imports are stubbed (:mod:`spec.engines.kit.stubs`) and the varlen
kwargs come from a mock (the report says which).
"""

from __future__ import annotations

import warnings
from typing import Any

from ...protocol.engine import Feature
from ...protocol.profile import ROUTES_SWITCH
from ...protocol.known import as_records
from dataclasses import replace

from ..verl.adapter import VerlEngine, VerlEngineObject
from ..verl.media import VERL_MM_SURFACE, VERL_MM_UNREACHABLE
from ..verl.profile import VERL_OFF_PATH, VERL_SURFACE, VERL_UNREACHABLE
from .media import VeOmniEngineObject
from .router_replay import ROUTER_REPLAY, RouterReplay, replay_hooks
from ..kit.stubs import StubReport, import_with_stubs

__all__ = ["VeOmniEngine", "KNOWN_FAILURES"]

MODULE = "verl.workers.engine.veomni.transformer_impl"

_ULYSSES, _FSDP = "verl.utils.ulysses:", "verl.workers.engine.fsdp.transformer_impl"
_SP = ("needs VeOmni's sequence parallelism (veomni.distributed.parallel_state's process group): sp > 1 is not run "
       "(VeOmniEngine.lacks)")
#: branches of the surface no CPU run of the suite reaches (verl 0.9.1's lines): the FSDP ones but verl's Ulysses
#: helpers' (off the surface here), and VeOmni's own
UNREACHABLE: dict[str, str] = {
    **{k: v for k, v in VERL_UNREACHABLE.items() if not k.startswith(_ULYSSES)},
    f"{_FSDP}:687->688": _SP, f"{_FSDP}:1218->1219": _SP, f"{_FSDP}:1220": _SP,
    **VERL_MM_UNREACHABLE,
    f"{MODULE}:117": "needs a vision-language model type and sequence parallelism (VeOmni's sp_shard_collator on the "
                     "image/video masks); " + _SP, f"{MODULE}:123->124": _SP,
    f"{MODULE}:873": _SP, f"{MODULE}:920->921": _SP,
}

#: failures of VeOmni beyond the FSDP ones it inherits (spec/engines/veomni/README.md)
KNOWN_FAILURES: dict[str, str] = {}


def load_veomni() -> StubReport:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_with_stubs(MODULE, ("veomni",))


class VeOmniEngine(VerlEngine):
    """The installed verl's VeOmni engines, through the FSDP adapter's construction."""

    name = "verl-veomni"
    object_class = VeOmniEngineObject
    #: FSDP's surface (VeOmni's engines inherit its preparation) and VeOmni's own input transforms
    #: (verl's Ulysses helpers are not on its path: sp > 1 is not run, see lacks)
    profile = replace(VerlEngine.profile, surface=(*(e for e in VERL_SURFACE if not e.startswith(_ULYSSES)),
                                                   *VERL_MM_SURFACE, *(
        f"{MODULE}:{f}" for f in (
            "VeOmniEngine._apply_veomni_input_transforms", "VeOmniEngineWithLMHead.prepare_model_inputs",
            "VeOmniEngineWithLMHead._prepare_router_replay_inputs", "VeOmniEngineWithLMHead.prepare_model_outputs",
            "VeOmniEngineWithValueHead.prepare_model_inputs"))), unreachable=UNREACHABLE,
        off_path=VERL_OFF_PATH, refuses={},  # VeOmni's own preparation: its refusals not declared (not checked here)
        config_space=(*VerlEngine.profile.config_space, ROUTER_REPLAY), routes_modes=("packed",),
        media_marks=("image_mask", "video_mask"))  # VeOmni's VL models place the features at these

    def __init__(self) -> None:
        super().__init__()
        self.stubs = load_veomni()
        impl = self.stubs.module
        self._classes = {"lm": impl.VeOmniEngineWithLMHead, "value": impl.VeOmniEngineWithValueHead}
        self._replay_hooks, self._replay_error = replay_hooks()
        # FSDP's precise records (spec/engines/verl/records.py), plus VeOmni's own (none today)
        self.known_failures = (*as_records(self.known_failures),
                               *as_records({k: f"verl-veomni {self.caps.version}: {v}" for k, v in KNOWN_FAILURES.items()}))

    def lacks(self, feature: str | Feature) -> str | None:  # type: ignore[override]
        if Feature.parse(feature) is Feature.ROUTES and self._replay_hooks is None:
            return ("router replay hooks the routers through veomni.utils.moe_router_replay, which does not import "
                    f"here ({self._replay_error})")
        if Feature.parse(feature) is Feature.SP:
            return ("VeOmni slices for sequence parallelism through veomni.distributed.parallel_state (a process "
                    "group); the suite's thread-rank all_gather seam is not VeOmni's, so sp > 1 is not run")
        return super().lacks(feature)

    def make(self, head: str = "lm", **settings: Any) -> VerlEngineObject:
        routes = settings.pop(ROUTES_SWITCH, None)
        obj = super().make(head, **settings)
        eng = obj.verl_engine
        eng._router_replay = None  # router replay off (VeOmniEngine.__init__ sets it from the config)
        eng.module.config.model_type = "toy"  # a text model; a VL type for a media micro-batch (veomni/media.py)
        obj.vl_types = self.stubs.module.VL_TYPE2INDEX
        if routes is not None and head == "lm":  # a critic's batches never ask replay (no enable_routing_replay)
            if self._replay_hooks is None:
                raise NotImplementedError(self.lacks(Feature.ROUTES))
            obj.router_replay = RouterReplay(self.stubs.module.VeOmniRouterReplay, self._replay_hooks, routes)
        return obj

    def __repr__(self) -> str:
        return f"<engine verl-veomni {self.caps.version}>"
