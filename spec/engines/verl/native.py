"""Shared construction for verl engines with their own ``prepare_model_*`` (TorchTitan, Automodel).

Like the FSDP adapter: the engine class is instantiated without ``__init__`` (no model, no process
group, no device mesh) and only the attributes its preparation reads are set, with the values its
constructor would give them for a single-rank, uncompiled run. The calling convention is adapted in
a thin engine object; nothing of verl's code is copied and verl is not patched.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from ...protocol.known import KnownFailure
from ...protocol.engine import EngineUnderTest, Feature, Precision
from ...protocol.profile import MEDIA, ConfigSwitch, EngineProfile, equivalents_on
from .microbatch_records import MICROBATCH_RECORDS
from ..kit.stubs import import_verl_module
from .microbatch_layer import verl_microbatch_layer
from .media import VERL_MM_SURFACE, VERL_MM_UNREACHABLE
from .mutants import VERL_EQUIVALENT_MUTANTS
from .records import verl_precision
from .profile import (ENTROPY_CHECKPOINTING, VERL_LAYER, VERL_LAYER_OFF_PATH, VERL_LAYER_UNREACHABLE,
                      VERL_LOGITS_HELPERS, VERL_LOGITS_UNREACHABLE)

__all__ = ["NativeVerlEngine", "native_surface", "NATIVE_LOGITS_HELPERS", "NATIVE_UNREACHABLE", "NATIVE_OFF_PATH",
           "native_profile"]


#: verl's log-prob helpers the native engines call (neither calls calculate_sum_pi_squared_from_logits: verl 0.9.1's
#: TorchTitan and Automodel engines compute no sum_pi_squared)
NATIVE_LOGITS_HELPERS = tuple(h for h in VERL_LOGITS_HELPERS if not h.endswith(":calculate_sum_pi_squared_from_logits"))


def native_surface(module: str, lm_class: str, helpers: tuple[str, ...] = NATIVE_LOGITS_HELPERS) -> tuple[str, ...]:
    """A native engine's surface: its own prepare_model_inputs / prepare_model_outputs, verl's log-prob ``helpers`` it
    calls (verl.utils.torch_functional; neither calls verl's padding or Ulysses helpers), verl's multi-modal helpers
    (both call extract_multi_modal_inputs on every micro-batch: spec/engines/verl/media.py) and the micro-batch
    layer."""
    return (f"{module}:{lm_class}.prepare_model_inputs", f"{module}:{lm_class}.prepare_model_outputs",
            *helpers, *VERL_MM_SURFACE, *VERL_LAYER)


#: the branches of the shared part of their surfaces no CPU run reaches (verl 0.9.1's lines), with the reasons
NATIVE_UNREACHABLE: dict[str, str] = {**VERL_LAYER_UNREACHABLE, **VERL_LOGITS_UNREACHABLE, **VERL_MM_UNREACHABLE}
NATIVE_OFF_PATH: dict[str, str] = dict(VERL_LAYER_OFF_PATH)


def native_profile(base: EngineProfile, module: str, lm_class: str, own: Mapping[str, str],
                   switches: tuple[ConfigSwitch, ...] = (), equivalents: Mapping[str, str] = {},
                   helpers: tuple[str, ...] = NATIVE_LOGITS_HELPERS) -> EngineProfile:
    """A native engine's profile: ``base`` with its surface (:func:`native_surface`), images and videos drawn (both
    engines hand ``extract_multi_modal_inputs``' keys to the model beside mRoPE positions, in both modes), the shared
    off-path functions, its configuration (:data:`ENTROPY_CHECKPOINTING`, and its own ``switches``), as unreachable
    the shared branches and its ``own`` branches (``"LINE->DEST"`` or ``"LINE"`` of ``module`` -> reason), and verl's
    equivalent-mutant declarations on the functions it shares with the FSDP engine, with its own ``equivalents``
    (mutant id -> why no input tells it from the engine's code); ``helpers``: verl's log-prob helpers it calls."""
    surface = native_surface(module, lm_class, helpers)
    return replace(base, surface=surface, off_path=NATIVE_OFF_PATH, media=MEDIA,
                   config_space=(ENTROPY_CHECKPOINTING, *switches),
                   equivalent_mutants={**equivalents_on(VERL_EQUIVALENT_MUTANTS, surface), **equivalents},
                   unreachable={**NATIVE_UNREACHABLE, **{f"{module}:{line}": why for line, why in own.items()}})


class NativeVerlEngine(EngineUnderTest):
    """Base of the TorchTitan and Automodel adapters. Subclasses set ``module``, ``packages``,
    ``lm_class``, ``records`` and implement :meth:`wrap`."""

    module = ""
    packages: tuple[str, ...] = ()
    lm_class = ""
    records: dict[str, dict[str, object]] = {}
    sp_reason = "sequence/context parallelism runs through a process group the suite does not simulate"
    #: version -> known-failure records (``spec.protocol.known.KnownFailure``); "*" for every version
    #: (spec/engines/<engine>/README.md has a minimal counterexample for each)
    KNOWN: dict[str, tuple[KnownFailure, ...]] = {}
    #: strategy limits that keep a documented bug out of unrelated invariants (none here: bf16/fp16 logits are drawn,
    #: :meth:`precision` declares each output's dtype and the differences are records)
    LIMITS: dict[str, Any] = {}

    def __init__(self) -> None:
        self.version, self.stubs = import_verl_module(self.name, self.module, self.packages, self.records)
        from verl.utils import torch_functional as verl_F

        self._verl_F = verl_F
        self.cls = getattr(self.stubs.module, self.lm_class)
        self.outputs_params = tuple(inspect.signature(self.cls.prepare_model_outputs).parameters)
        self.known_failures = (*self.KNOWN.get("*", ()), *self.KNOWN.get(self.version, ()),
                               *MICROBATCH_RECORDS.get("*", ()), *MICROBATCH_RECORDS.get(self.version, ()))

    def microbatch_layer(self):
        """verl's own micro-batch functions: this engine's forward_backward_batch calls prepare_micro_batches and
        postprocess_batch_func like every verl engine."""
        if not hasattr(self, "_microbatch"):
            self._microbatch = verl_microbatch_layer()
        return self._microbatch

    # -- capabilities ------------------------------------------------------------------------------
    def _no(self, what: str) -> str:
        return f"{self.name} {self.version}: {what}"

    def lacks(self, feature: str | Feature) -> str | None:
        feature = Feature.parse(feature)
        if feature is Feature.VALUE and not hasattr(self.stubs.module, self.lm_class.replace("LMHead", "ValueHead")):
            return self._no(f"{self.module} has no value-head engine")
        if feature is Feature.DISTILLATION and "logits_processor_func" not in self.outputs_params:
            return self._no("prepare_model_outputs takes no logits_processor_func (no top-K distillation)")
        if feature is Feature.BUCKET and "pad_to_length" not in _source(self.cls.prepare_model_inputs):
            return self._no("prepare_model_inputs has no static pad_to_length bucket")
        if feature is Feature.CHUNKING and "entropy_from_logits_with_chunking" not in _source(self.cls.prepare_model_outputs):
            return self._no("prepare_model_outputs does not chunk the entropy")
        if feature is Feature.FUSED and "use_fused_kernels" not in _source(self.cls.prepare_model_inputs):
            return self._no("prepare_model_inputs has no fused-kernel path")
        if feature is Feature.SUM_PI_SQUARED and "calculate_sum_pi_squared" not in _source(self.cls.prepare_model_outputs):
            return self._no("prepare_model_outputs never reads calculate_sum_pi_squared (no sum_pi_squared output)")
        if feature is Feature.SP:
            return self._no(self.sp_reason)
        if feature in (Feature.BUILD_ATTENTION_MASK, Feature.NO_PADDING_2_PADDING, Feature.LEFT_RIGHT_2_NO_PADDING,
                       Feature.RESPONSE_FROM_NESTED, Feature.RESPONSE_TO_NESTED):
            return self._no(f"{feature.value} is verl.workers.utils.padding's, shared by every verl engine and "
                            "checked under --engine verl; not re-run here")
        return super().lacks(feature)

    def strategy_limits(self) -> dict[str, Any]:
        return {**super().strategy_limits(), **self.LIMITS}  # the features it lacks, then LIMITS

    def precision(self, key: str, case: Any) -> Precision:  # type: ignore[override]
        """The FSDP engine's rule (:func:`spec.engines.verl.records.verl_precision`): log_probs and entropy in the logits'
        dtype, the packed chunked entropy in float32, fused kernels' values in the model's float32."""
        return verl_precision(key, case)

    # -- engine objects --------------------------------------------------------------------------
    def build(self, chunk: int | None, checkpointing: bool = False) -> Any:
        """The verl engine object, built without ``__init__`` (single rank, not compiled)."""
        eng = object.__new__(self.cls)
        eng.engine_config = SimpleNamespace(entropy_checkpointing=checkpointing, entropy_from_logits_with_chunking=bool(chunk),
                                            entropy_from_logits_chunk_size=int(chunk or 2048),
                                            use_torch_compile=False, attn_type="varlen", attn_implementation="sdpa")
        eng.compute_entropy_from_logits = (self._verl_F.entropy_from_logits_with_chunking if chunk
                                           else self._verl_F.entropy_from_logits)
        return eng

    def make(self, head: str = "lm", **settings: Any) -> Any:
        for feature, keys in ((Feature.SP, ("sp_size",)), (Feature.BUCKET, ("pad_to_length",)),
                              (Feature.CU_SEQLENS, ("pass_cu_seqlens",)), (Feature.CHUNKING, ("entropy_chunk_size",))):
            if any(settings.get(k) not in (None, False, 1, 0) for k in keys) and self.lacks(feature):
                raise NotImplementedError(self.lacks(feature))
        if head != "lm":
            raise NotImplementedError(self.lacks(Feature.VALUE))
        unknown = set(settings) - {"sp_size", "sp_rank", "all_gather", "pad_to_length", "pass_cu_seqlens",
                                   "entropy_chunk_size", *(switch.name for switch in self.profile.config_space)}
        if unknown:
            raise TypeError(f"unknown engine settings for {self.name}: {sorted(unknown)}")
        return self.wrap(self.build(settings.get("entropy_chunk_size"), bool(settings.get("entropy_checkpointing"))))

    def wrap(self, eng: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<engine {self.name} {self.version}>"


def _source(fn: Callable) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
