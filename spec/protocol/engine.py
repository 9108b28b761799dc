"""The engine protocol: what the suite asks of an engine under test, typed.

This module imports nothing from ``spec`` (tests/test_layering.py checks it): adapters, the
registry, the runner and the invariants all depend on it, never the other way round.

* :class:`EngineUnderTest` builds engine objects (:class:`EngineObject`: verl's two methods) for
  given settings, hands out the padding helpers it ships, and says what it lacks.
* :class:`Feature` names what an invariant may need (``InvariantInfo.needs`` holds its values);
  :class:`Capabilities` is the probed record of what one engine offers, with the reason for each
  feature it lacks, so a missing feature is a skip with its reason.
* :class:`ShardLayout`: how the engine splits a packed row across ranks (one contiguous slice per
  rank, as Ulysses does, or two chunks per sequence per rank, zig-zag, as Megatron's context
  parallelism does). What a sequence's outputs are does not depend on it.
* :class:`InputsView` / :class:`OutputsView`: the normalized view of what an engine produced (ids,
  positions, mask or boundaries, labels, temperature; per-sequence nested outputs). Each adapter maps
  its engine's own calling convention onto it (:meth:`EngineUnderTest.view_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
import inspect
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

__all__ = ["Feature", "ShardLayout", "Capabilities", "EngineObject", "EngineUnderTest", "InputsView",
           "OutputsView", "Precision", "CONTRACT_PRECISION", "ConfigSwitch", "verl_fsdp_view", "HELPERS", "HELPER_FEATURES",
           "ENGINE_FEATURE"]


class Feature(str, Enum):
    """What an invariant may need from an engine (``InvariantInfo.needs`` holds the values)."""

    #: the engine object itself: prepare_model_inputs / prepare_model_outputs on a micro-batch
    ENGINE = "engine"
    SP = "sp"  # sequence parallelism (sp_size, sp_rank, all_gather settings)
    BUCKET = "bucket"  # static pad_to_length bucket
    CU_SEQLENS = "cu_seqlens"  # packed cu_seqlens passed to the model
    CHUNKING = "chunking"  # chunked entropy
    VALUE = "value"  # a value head
    FUSED = "fused"  # fused kernels (the model returns log_probs/entropy)
    DISTILLATION = "distillation"  # top-K distillation through logits_processor_func
    CUDA = "cuda"
    #: ranks as processes joined by a torch.distributed process group (spec/execute/ranks.py)
    REAL_RANKS = "real_ranks"
    #: Megatron-style packing: per-sequence TP x CP alignment, CP split, pack/unpack round trip
    PACKING = "packing"
    #: the input step hands the output step its temperature (per packed token, or per sample padded), as
    #: verl's FSDP convention does, rather than the output step reading the micro-batch again
    TEMPERATURE_HANDOFF = "temperature_handoff"
    #: the sum of squared probabilities output (``calculate_sum_pi_squared``)
    SUM_PI_SQUARED = "sum_pi_squared"
    BUILD_ATTENTION_MASK = "build_attention_mask_from_nested"
    NO_PADDING_2_PADDING = "no_padding_2_padding"
    LEFT_RIGHT_2_NO_PADDING = "left_right_2_no_padding"
    RESPONSE_FROM_NESTED = "response_from_nested"
    RESPONSE_TO_NESTED = "response_to_nested"

    @classmethod
    def parse(cls, name: "str | Feature") -> "Feature":
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown feature {name!r}; features: {[f.value for f in cls]}") from None


ENGINE_FEATURE = Feature.ENGINE
HELPER_FEATURES = (Feature.BUILD_ATTENTION_MASK, Feature.NO_PADDING_2_PADDING, Feature.LEFT_RIGHT_2_NO_PADDING,
                   Feature.RESPONSE_FROM_NESTED, Feature.RESPONSE_TO_NESTED)
#: the padding helpers an engine may ship (names as in verl.workers.utils.padding)
HELPERS = tuple(f.value for f in HELPER_FEATURES)


class ShardLayout(str, Enum):
    CONTIGUOUS = "contiguous"  # rank r holds rows [r*n/w, (r+1)*n/w) of the padded packed row
    ZIGZAG = "zigzag"  # each sequence in 2w chunks; rank r holds chunks r and 2w-1-r


@dataclass(frozen=True)
class Capabilities:
    """What one engine offers, probed: ``missing`` maps each lacking feature to why."""

    engine: str
    missing: Mapping[Feature, str]
    layouts: tuple[ShardLayout, ...] = (ShardLayout.CONTIGUOUS,)

    @property
    def offered(self) -> frozenset[Feature]:
        return frozenset(f for f in Feature if f not in self.missing)

    def reason(self, feature: "str | Feature") -> str | None:
        return self.missing.get(Feature.parse(feature))

    def table(self) -> list[tuple[str, str]]:
        """(feature, "yes" or the reason it is lacking), in enum order."""
        return [(f.value, self.missing.get(f, "yes")) for f in Feature]


@runtime_checkable
class EngineObject(Protocol):
    """One engine object, with verl's FSDP calling convention (adapters translate to it)."""

    def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def prepare_model_outputs(self, output: Any, output_args: dict[str, Any], micro_batch: Any,
                              logits_processor_func: Callable | None = None) -> dict[str, torch.Tensor]: ...


@dataclass
class InputsView:
    """What one rank hands the model and its own output step, normalized. Invariants read this, never an
    engine's private keys; each adapter maps its engine's convention onto it (:meth:`EngineUnderTest.view_inputs`).

    ``None`` everywhere means "the engine hands no such thing".

    * ``input_ids`` / ``position_ids`` / ``attention_mask``: the model's inputs (packed: ``(1, n)``, positions
      ``(1, n)`` or ``(4, 1, n)`` for mRoPE, no mask; padded: ``(B, L)``, ``(B, L)`` or ``(4, B, L)``, the mask).
    * ``cu_seqlens``: packed sequence boundaries handed to the model, flat ``(B + 1,)`` (or ``(B + 2,)`` with a
      final boundary for tail padding); ``cu_seqlens_host``: a host (CPU) copy of them, where handed too.
    * ``labels``: flat, for each packed token the id its output scores (the row rolled left by one).
    * ``temperature``: what the output step scales the logits by, as the input step hands it over: per packed
      token (packed) or per sample (padded). None when the output step reads the micro-batch itself.
    * ``pad_size``: tokens of tail padding appended to the packed row (bucket plus sequence parallelism).
    * ``model_temperature`` / ``model_labels`` / ``return_dict``: what a fused-kernel model is handed (one
      float temperature, the labels it scores as ``(1, n)``, whether it returns a dict).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_host: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    temperature: torch.Tensor | float | None = None
    pad_size: int = 0
    model_temperature: Any = None
    model_labels: torch.Tensor | None = None
    return_dict: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def verl_fsdp_view(model_inputs: Mapping[str, Any], output_args: Mapping[str, Any]) -> InputsView:
    """The normalized view of verl's FSDP convention (impl, verl's FSDP and VeOmni engines, Automodel):
    ``output_args`` carry ``input_ids_rmpad_rolled`` and ``temperature_rmpad`` (packed) or ``temperature``
    (padded) and ``pad_size``; ``model_inputs`` may carry ``cu_seqlens``/``cu_seqlens_cpu`` and, for fused
    kernels, ``temperature``, ``shift_labels`` and ``return_dict``."""
    temperature = output_args.get("temperature_rmpad", output_args.get("temperature"))
    labels = output_args.get("input_ids_rmpad_rolled")
    return InputsView(input_ids=model_inputs["input_ids"], position_ids=model_inputs.get("position_ids"),
                      attention_mask=model_inputs.get("attention_mask"), cu_seqlens=model_inputs.get("cu_seqlens"),
                      cu_seqlens_host=model_inputs.get("cu_seqlens_cpu"),
                      labels=None if labels is None else labels.reshape(-1),
                      temperature=temperature,
                      pad_size=int(output_args.get("pad_size", 0) or 0),
                      model_temperature=model_inputs.get("temperature"), model_labels=model_inputs.get("shift_labels"),
                      return_dict=model_inputs.get("return_dict"))


@dataclass(frozen=True)
class Precision:
    """How an engine computes one output key on one path, as it declares it (:meth:`EngineUnderTest.precision`).

    ``returns``: the dtype the output comes back in. ``scaled_in``: the dtype of the temperature-scaled logits it
    is computed from (verl scales bf16 logits in bf16 and takes the log-softmax there). The contract's is float32
    for both (:data:`CONTRACT_PRECISION`); value invariants compare an engine at the precision it declares (the
    float64 oracle rounded to ``returns``, that dtype's rounding of the scaled logits and of the result in the
    tolerance: :meth:`spec.truth.oracle.Expected.at_precision`), so a mistake beyond that rounding still fails,
    and INV-DEV-001 still holds the engine to float32 (a declared other dtype is a known failure there)."""

    returns: str = "float32"
    scaled_in: str = "float32"

    def __str__(self) -> str:
        return self.returns if self.returns == self.scaled_in else f"{self.returns} from {self.scaled_in} logits"


CONTRACT_PRECISION = Precision()


@dataclass(frozen=True)
class ConfigSwitch:
    """One switch of an engine's own configuration that changes the code path of its preparation, declared by its
    adapter (:meth:`EngineUnderTest.config_space`) so the strategies draw it like any other dimension.

    ``values``: the values drawn, the first the default (where a case shrinks); ``unseen``: values the engine has
    that the suite does not draw, each with why (the coverage report shows them). ``setting``: the switch is drawn
    as the suite's own engine setting of that name (an ``EngineCase`` field such as ``entropy_chunk_size``; its
    values are the setting's), not as a draw of its own. ``needs``: features (:class:`Feature` values) the engine
    must offer for the switch to apply; ``text``: what it switches. A drawn value reaches the engine as the keyword
    ``make(head, **settings, name=value)``."""

    name: str
    values: tuple[Any, ...] = ()
    text: str = ""
    needs: tuple[str, ...] = ()
    setting: str | None = None
    unseen: Mapping[Any, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.setting is None and not self.values:
            raise ValueError(f"config switch {self.name!r} draws no value (give values, or the setting it is drawn as)")
        for need in self.needs:
            Feature.parse(need)


@dataclass
class OutputsView:
    """Per-token outputs, each a nested tensor over the full sequences (offsets = cu_seqlens)."""

    per_sequence: dict[str, torch.Tensor]


def _itself(engine: "EngineUnderTest") -> "EngineUnderTest":
    return engine


class EngineUnderTest:
    """Base class of every engine under test. Subclasses implement :meth:`make`, may override the rest."""

    name = "engine"
    #: a failure the suite knows about and documents (reported, not hidden); the runner looks it up by
    #: ``ID/mode`` then ``ID``
    known_failures: Any = ()  # spec.protocol.known.KnownFailure records (a legacy {ID: reason} dict is read too)
    #: how the engine splits a packed row across ranks
    layouts: tuple[ShardLayout, ...] = (ShardLayout.CONTIGUOUS,)
    #: Megatron-style packer (``spec.truth.megatron_packing.Packer``) where the engine offers ``Feature.PACKING``
    packer: Any = None
    #: its ``sp > 1`` cases need a real process group (verl's Ulysses path): they run on real ranks
    sp_on_real_ranks: bool = False
    #: how a rank process rebuilds this engine: ``(callable, args)``, pickled by reference (set by whoever
    #: builds an engine that its class alone cannot rebuild, e.g. the registry for ``planted:<bug>``)
    built_by: tuple[Callable[..., Any], tuple[Any, ...]] | None = None

    def recipe(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """``(callable, args)`` that builds this engine again in another process: :attr:`built_by`, else the
        class called with no arguments where it takes none, else the object itself (pickled by value)."""
        if self.built_by is not None:
            return self.built_by
        try:
            inspect.signature(type(self)).bind()
        except TypeError:
            return (_itself, (self,))
        return (type(self), ())

    def make(self, head: str = "lm", **settings: Any) -> EngineObject:
        """An engine object; settings: sp_size, sp_rank, all_gather, pad_to_length, pass_cu_seqlens,
        entropy_chunk_size."""
        raise NotImplementedError

    def helper(self, name: str) -> Callable | None:
        return None

    def strategy_limits(self) -> dict[str, Any]:
        """Strategy keyword arguments that keep drawn cases within what the engine supports: features it does
        not offer, never a region of inputs it gets wrong (that is a :class:`~spec.protocol.known.KnownFailure`
        record; tests/test_regimes.py fails on a limit that excludes a logits dtype or a context)."""
        return {}

    def config_space(self) -> tuple[ConfigSwitch, ...]:
        """The engine's own configuration switches that change its preparation's code path (the strategies draw
        each; a case prints the drawn values, the report shows which values ran). Default: none."""
        return ()

    def precision(self, key: str, case: Any) -> Precision:
        """The precision output ``key`` comes back in for ``case`` (an ``EngineCase``: the logits' dtype, the
        path its flags and settings take). The default is the contract's: float32, from float32 scaled logits."""
        return CONTRACT_PRECISION

    def lacks(self, feature: "str | Feature") -> str | None:
        """Why the engine cannot run invariants needing ``feature``, or None (an unknown name is a
        ValueError: a typo must not read as "offered")."""
        feature = Feature.parse(feature)
        if feature in HELPER_FEATURES:
            return None if self.helper(feature.value) is not None else f"engine {self.name} ships no {feature.value}"
        if feature is Feature.CUDA:
            return None if torch.cuda.is_available() else "no CUDA device"
        if feature is Feature.REAL_RANKS and not torch.distributed.is_available():
            return "this torch has no torch.distributed"
        if feature is Feature.PACKING and self.packer is None:
            return f"engine {self.name} has no Megatron-style packing (pack/unpack across TP x CP ranks)"
        return None

    def implied_needs(self, needs: tuple[str, ...]) -> str | None:
        """Why an invariant with ``needs`` cannot run here beyond those needs: every invariant that does
        not check the packing runs the engine object (:attr:`Feature.ENGINE`)."""
        if Feature.PACKING.value in needs:
            return None
        return self.lacks(Feature.ENGINE)

    def capabilities(self) -> Capabilities:
        """Every feature probed through :meth:`lacks`."""
        missing = {}
        for feature in Feature:
            reason = self.lacks(feature)
            if reason:
                missing[feature] = reason
        return Capabilities(self.name, missing, tuple(self.layouts))

    def view_inputs(self, model_inputs: Mapping[str, Any], output_args: Mapping[str, Any]) -> InputsView:
        """The normalized view of one rank's hand-off (``model_inputs``, ``output_args``: what the engine
        object's ``prepare_model_inputs`` returned). The default reads verl's FSDP convention
        (:func:`verl_fsdp_view`); an engine with another one overrides this."""
        return verl_fsdp_view(model_inputs, output_args)

    def view_outputs(self, outputs: Mapping[str, torch.Tensor]) -> OutputsView:
        """The normalized view of one rank's ``prepare_model_outputs`` result: the contract's keys
        (``log_probs``, ``entropy``, ...), each nested over the full sequences. The default takes the dict as
        it is (verl's convention); an engine returning another shape or other names maps it here."""
        return OutputsView(dict(outputs))

    def __repr__(self) -> str:
        return f"<engine {self.name}>"
