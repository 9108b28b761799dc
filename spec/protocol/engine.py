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

from dataclasses import dataclass, field, replace
from enum import Enum
import inspect
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import torch

from .profile import (AUDIO_INPUT_KEYS, DEFAULT_PROFILE, MEDIA_INPUT_KEYS, ROUTES_RECORDED, ROUTES_SWITCH, VISION, ConfigSwitch, EngineProfile, Feature, HeadInput, OutputSpan,
                      PaddedLayout, drawn_config, token_columns)
from .vendor import source

__all__ = ["Feature", "ShardLayout", "PaddedLayout", "OutputSpan", "HeadInput", "Capabilities", "EngineObject",
           "EngineUnderTest", "InputsView", "OutputsView", "Precision", "CONTRACT_PRECISION", "ConfigSwitch",
           "ReproSnippet", "verl_fsdp_view", "media_view", "MEDIA_TOKEN_TYPES", "MEDIA_TOKEN_MARKS", "HELPERS",
           "HELPER_FEATURES", "ENGINE_FEATURE", "response_view", "completion_view", "action_view",
           "sequences_from_responses", "sequences_from_rows", "read_flags", "FLAG_DEFAULTS", "sp_process_group"]


ENGINE_FEATURE = Feature.ENGINE
#: each ``engine_cases`` limit and the feature whose lack sets it (:meth:`EngineUnderTest.strategy_limits`)
LIMIT_FEATURES = {"allow_sp": Feature.SP, "allow_bucket": Feature.BUCKET, "allow_distillation": Feature.DISTILLATION,
                  "allow_cu_seqlens": Feature.CU_SEQLENS, "allow_fused": Feature.FUSED,
                  "allow_chunking": Feature.CHUNKING, "allow_sum_pi_squared": Feature.SUM_PI_SQUARED}
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
    * ``media``: the images' and videos' features and grids handed to the model, by the model's key names
      (``spec.protocol.profile.MEDIA_INPUT_KEYS``: ``pixel_values``, ``image_grid_thw``, ...) and the token types
      marks where handed (:data:`MEDIA_TOKEN_MARKS`); empty for none.
    * ``routes``: the routed experts handed on for router replay, one ``(n_i, layers, top_k)`` tensor per sample
      (each token's), as the engine collated them; None for none.
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
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    routes: list[torch.Tensor] | None = None


def verl_fsdp_view(model_inputs: Mapping[str, Any], output_args: Mapping[str, Any]) -> InputsView:
    """The normalized view of verl's FSDP convention (impl, verl's FSDP and VeOmni engines, Automodel):
    ``output_args`` carry ``input_ids_rmpad_rolled`` and ``temperature_rmpad`` (packed) or ``temperature``
    (padded) and ``pad_size`` (and, where the engine collates routed experts, ``routes``); ``model_inputs`` may carry
    ``cu_seqlens``/``cu_seqlens_cpu`` and, for fused kernels, ``temperature``, ``shift_labels`` and
    ``return_dict``."""
    temperature = output_args.get("temperature_rmpad", output_args.get("temperature"))
    labels = output_args.get("input_ids_rmpad_rolled")
    return InputsView(input_ids=model_inputs["input_ids"], position_ids=model_inputs.get("position_ids"),
                      attention_mask=model_inputs.get("attention_mask"), cu_seqlens=model_inputs.get("cu_seqlens"),
                      cu_seqlens_host=model_inputs.get("cu_seqlens_cpu"),
                      labels=None if labels is None else labels.reshape(-1),
                      temperature=temperature,
                      pad_size=int(output_args.get("pad_size", 0) or 0),
                      model_temperature=model_inputs.get("temperature"), model_labels=model_inputs.get("shift_labels"),
                      return_dict=model_inputs.get("return_dict"), media=media_view(model_inputs),
                      routes=output_args.get("routes"))


#: the model inputs that mark the media tokens of the ids: ``mm_token_type_ids`` each token text (0), image (1) or video
#: (2), which a Hugging Face vision-language model of transformers 5 computes its mRoPE positions from (Qwen2-VL's
#: ``get_rope_index``; handed by TRL's GRPO from the processor, by OpenRLHF's and SkyRL's forward from the ids); VeOmni's
#: ``image_mask`` / ``video_mask``, where its VL models place the features
MEDIA_TOKEN_TYPES = "mm_token_type_ids"
MEDIA_TOKEN_MARKS = (MEDIA_TOKEN_TYPES, "image_mask", "video_mask")


def sp_process_group(sp_size: Any, sp_rank: Any, all_gather: Any, library: str) -> Any:
    """The ``torch.distributed`` process group an engine's sequence parallelism reads (verl's Ulysses path, SkyRL's),
    from :meth:`EngineUnderTest.make`'s settings: None for ``sp_size`` 1; above 1, the ``all_gather``'s ``.group``
    (on the suite's real ranks, :class:`impl.sequence_parallel.TorchDistributedAllGather` carries it), whose world size
    and rank must be ``sp_size`` and ``sp_rank``. ``library`` names the engine in the errors."""
    if int(sp_size or 1) <= 1:
        return None
    group = getattr(all_gather, "group", None)
    if group is None:
        raise NotImplementedError(
            f"{library} sequence parallelism (sp_size={sp_size}) needs a torch.distributed process group: pass an "
            "all_gather with a .group (impl.sequence_parallel.TorchDistributedAllGather) on real ranks "
            "(spec.execute.ranks)")
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if world != int(sp_size) or rank != sp_rank:
        raise ValueError(f"{library}: sp_size={sp_size}, sp_rank={sp_rank} do not match the process group "
                         f"(world {world}, rank {rank})")
    return group


def media_view(model_inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The media keys a model takes (:data:`~spec.protocol.profile.MEDIA_INPUT_KEYS`, ``AUDIO_INPUT_KEYS`` and
    :data:`MEDIA_TOKEN_MARKS`) as ``model_inputs`` hands them (an engine's convention of the Hugging Face model's
    keyword arguments: verl's, TRL's, OpenRLHF's, SkyRL's)."""
    return {key: model_inputs[key] for key in (*(k for pair in MEDIA_INPUT_KEYS.values() for k in pair),
                                               *AUDIO_INPUT_KEYS, *MEDIA_TOKEN_MARKS)
            if model_inputs.get(key) is not None}


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


@dataclass
class OutputsView:
    """Per-token outputs, each a nested tensor over the full sequences (offsets = cu_seqlens); ``routes``: the MoE
    routes the engine recorded (router replay's R2 record: the output ``routed_experts``), one ``(n_i, layers,
    top_k)`` tensor per sample, or None where it records none."""

    per_sequence: dict[str, torch.Tensor]
    routes: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class ReproSnippet:
    """How a standalone reproducer (``spec/repro``) builds and calls this engine: Python source that defines

    * ``make_engine(head, **settings)``: an object with verl's FSDP calling convention
      (``prepare_model_inputs(mb)``, ``prepare_model_outputs(output, output_args, mb, logits_processor_func)``);
    * ``helper(name)``: the padding helper ``name`` (``no_padding_2_padding``, ...) or None;

    and optionally ``view_inputs(model_inputs, output_args) -> dict`` (the :class:`InputsView` fields by name:
    ``attention_mask``, ``labels``, ``input_ids``, ``position_ids``, ``cu_seqlens``, ``temperature``, ``pad_size``, ...:
    what the model got and what the output step is handed; a key left out reads as None) and ``view_outputs(outputs) -> dict``
    (the contract's keys, nested over the full sequences) where the engine's convention is not verl's, and
    ``logits_processor(case, sp_size, sp_rank)`` (the engine's own top-K processor, :meth:`EngineUnderTest.logits_processor`,
    or None for the suite's stand-in, which the file writes out).

    ``requires``: what to ``pip install`` besides torch and tensordict; ``standalone``: the code imports
    nothing of this suite (False for the default, which imports the adapter itself)."""

    code: str
    requires: str = ""
    standalone: bool = True


def _itself(engine: "EngineUnderTest") -> "EngineUnderTest":
    return engine


class EngineUnderTest:
    """Base class of every engine under test. Subclasses implement :meth:`make`, may override the rest."""

    name = "engine"
    #: everything the suite may assume about this engine, in one record (:class:`spec.protocol.profile.EngineProfile`)
    profile: EngineProfile = DEFAULT_PROFILE
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

    @property
    def padded_layout(self) -> PaddedLayout:
        """Where the padded mode puts each sequence in its (B, L) model input: the profile's
        (:attr:`EngineProfile.padded_layout`)."""
        return self.profile.padded_layout

    @property
    def output_span(self) -> OutputSpan:
        """Which positions of each sequence its outputs cover: the profile's (:attr:`EngineProfile.output_span`)."""
        return self.profile.output_span

    @property
    def head_input(self) -> HeadInput:
        """What the model hands its output step: the profile's (:attr:`EngineProfile.head_input`)."""
        return self.profile.head_input

    #: the class attributes an adapter written before the profile held them may still set, and the profile field
    #: each becomes (:meth:`__init_subclass__`)
    _LEGACY = {"padded_layout": lambda value: {"padded_layouts": (PaddedLayout(value),)},
               "output_span": lambda value: {"output_span": OutputSpan(value)},
               "head_input": lambda value: {"head_input": HeadInput(value)}}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A legacy class attribute (``padded_layout``, ``output_span``, ``head_input`` = a value) becomes the
        subclass's profile's field (one record: what the suite reads is the profile)."""
        super().__init_subclass__(**kwargs)
        for name, field_of in EngineUnderTest._LEGACY.items():
            legacy = cls.__dict__.get(name)
            if legacy is not None and not isinstance(legacy, property):
                cls.profile = replace(cls.profile, **field_of(legacy))
                delattr(cls, name)

    def _switched(self, case: Any, field: str) -> Any:
        """``field`` of the first switch of its own configuration drawn off its default for ``case`` that declares
        one (:class:`ConfigSwitch`), or None."""
        drawn = drawn_config(case)
        return next((getattr(switch, field) for switch in self.config_space()
                     if getattr(switch, field) and switch.name in drawn), None)

    def output_span_of(self, case: Any) -> OutputSpan:
        """Which positions its outputs cover on ``case``: :attr:`output_span`, unless a switch of its own
        configuration drawn off its default for the case declares another (:attr:`ConfigSwitch.output_span`:
        OpenRLHF's ``action_mask``, response-only log-probs)."""
        return self._switched(case, "output_span") or self.output_span

    def padded_layout_of(self, case: Any) -> PaddedLayout:
        """Where its padded model input puts each sequence on ``case``: :attr:`padded_layout`, unless a switch of its
        own configuration drawn off its default for the case declares another (:attr:`ConfigSwitch.padded_layout`:
        TRL's SFT collator, whole sequences right-padded)."""
        return PaddedLayout(self._switched(case, "padded_layout") or self.padded_layout)

    def tail_multiple_of(self, case: Any) -> int | None:
        """The multiple its packed row is padded to at the tail on ``case``: the value of a switch of its own
        configuration that sets it (:attr:`ConfigSwitch.tail_multiple`: TRL's SFT ``pad_to_multiple_of``) where the
        case draws it, else the profile's :attr:`EngineProfile.tail_multiple`."""
        drawn = drawn_config(case)
        return next((int(drawn[switch.name]) for switch in self.config_space()
                     if switch.tail_multiple and drawn.get(switch.name)), self.profile.tail_multiple)

    def make(self, head: str = "lm", **settings: Any) -> EngineObject:
        """An engine object; settings: sp_size, sp_rank, all_gather, pad_to_length, pass_cu_seqlens,
        entropy_chunk_size."""
        raise NotImplementedError

    def helper(self, name: str) -> Callable | None:
        return None

    def strategy_limits(self) -> dict[str, Any]:
        """Strategy keyword arguments that keep drawn cases within what the engine supports: features it does
        not offer, never a region of inputs it gets wrong (that is a :class:`~spec.protocol.known.KnownFailure`
        record; tests/test_regimes.py fails on a limit that excludes a logits dtype or a context). The default
        draws no feature the engine lacks (:meth:`lacks`: one statement of each, with its reason) and one float
        temperature where the profile takes no per-sample ones. What the engine *is* (modes, position kinds, padded
        layout, execution contexts, per-sample temperatures) is its :attr:`profile`, which :meth:`lacks` reads and
        never this. (The other features still live here and in :meth:`lacks`; they move into the profile next.)"""
        limits: dict[str, Any] = {key: False for key, feature in LIMIT_FEATURES.items() if self.lacks(feature)}
        if not self.profile.per_sample_temperature:
            limits["per_sample_temperature"] = False
        return limits

    def config_space(self) -> tuple[ConfigSwitch, ...]:
        """The engine's own configuration switches that change its preparation's code path (the strategies draw
        each; a case prints the drawn values, the report shows which values ran): the profile's
        (:attr:`EngineProfile.config_space`)."""
        return tuple(self.profile.config_space)

    def logits_processor(self, case: Any, sp_size: int = 1, sp_rank: int = 0) -> Callable | None:
        """The engine's own ``logits_processor_func`` for ``case`` on rank ``sp_rank`` of ``sp_size`` (its companion:
        what a real trainer of this engine hands ``prepare_model_outputs``, e.g. verl's top-K forward KL), or None:
        the suite's stand-in (``spec.truth.oracle.TopKProcessor``). Called only for cases that ask for top-K
        distillation; the harness asks once per rank (threads or real ranks: a processor that reads process-global
        state, such as verl's Ulysses group, is given for real ranks only). Default: None."""
        return None

    def processor_keys(self, case: Any) -> tuple[str, ...] | None:
        """The keys the engine's own processor returns for ``case`` whatever the case asks (verl's returns all
        five), or None (the stand-in returns the keys the case asks). The strategies set a distillation case's
        keys to these (:func:`spec.invariants.core.honour_engine`), so every key a consumer reads is asserted."""
        return None

    def companions(self) -> dict[str, str]:
        """Each companion the harness hands this engine (``logits_processor``: the top-K distillation processor)
        and whose it is: ``"own"`` (the engine's own code runs) or ``"stand-in: <why>"`` (the suite's); shown in
        the verify report. Default: the suite's stand-in for every one."""
        return {"logits_processor": "stand-in: the suite's top-K processor (spec.truth.oracle.TopKProcessor); "
                                    "the engine gives none of its own"}

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
        if feature is Feature.PER_SAMPLE_TEMPERATURE and not self.profile.per_sample_temperature:
            return f"engine {self.name} takes one temperature per trainer (no per-sample temperatures)"
        if feature is Feature.MICROBATCH and self.microbatch_layer() is None:
            return f"engine {self.name} offers no micro-batch layer (prepare_micro_batches and its utilities)"
        if feature is Feature.TAIL_RULE and self.profile.tail_multiple is None and not any(
                switch.tail_multiple for switch in self.config_space()):
            return (f"engine {self.name} pads its packed row to no multiple of its own (its profile: tail_multiple=None, "
                    "and no switch of its configuration sets one)")
        if feature is Feature.MEDIA and not set(self.profile.media) & set(VISION):
            return (f"engine {self.name} hands its model no images or videos from multi_modal_inputs (its profile: "
                    f"media={self.profile.media!r})")
        if feature is Feature.ROUTES and not self._route_values() - {None, ROUTES_RECORDED}:
            return (f"engine {self.name} collates no routed experts (no switch {ROUTES_SWITCH!r} in its configuration "
                    "with a dtype of the rollout's routes: MoE router replay)")
        if feature is Feature.ROUTES_RECORD and ROUTES_RECORDED not in self._route_values():
            return (f"engine {self.name} records no routes (its configuration's switch {ROUTES_SWITCH!r} has no value "
                    f"{ROUTES_RECORDED!r}: MoE router replay's R2 record)")
        if feature is Feature.AUDIO and "audio" not in self.profile.media:
            return (f"engine {self.name} hands its model no audio clips from multi_modal_inputs (its profile: "
                    f"media={self.profile.media!r})")
        return None

    def load_library(self) -> None:
        """Import what the engine's objects may name, in this process (a third party's modules, with the stubs its
        adapter imports them with): the real-rank parent calls it before it unpickles a rank's reply. Nothing by
        default."""

    def microbatch_layer(self) -> Any:
        """The engine's micro-batch layer (a ``spec.protocol.microbatch.MicroBatchLayer``), or None."""
        return None

    def step_layer(self) -> Any:
        """The engine's training step (a ``spec.protocol.step.StepLayer``: its cuts, facts, losses and aggregation
        modes, and its own cut/facts/loss/restore functions), or None (the INV-STEP invariants are skipped)."""
        return None

    def implied_needs(self, needs: tuple[str, ...]) -> str | None:
        """Why an invariant with ``needs`` cannot run here beyond those needs: every invariant that does
        not check the packing runs the engine object (:attr:`Feature.ENGINE`)."""
        if Feature.PACKING.value in needs:
            return None
        if Feature.MICROBATCH.value in needs and Feature.ENGINE.value not in needs:
            return None  # the layer alone: no engine object runs
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

    def _route_values(self) -> set[Any]:
        """The values its configuration's router-replay switch (:data:`ROUTES_SWITCH`) takes: route dtypes, the
        R2 record; empty without one."""
        return {value for switch in self.config_space() if switch.name == ROUTES_SWITCH for value in switch.values}

    def view_outputs(self, outputs: Mapping[str, torch.Tensor]) -> OutputsView:
        """The normalized view of one rank's ``prepare_model_outputs`` result: the contract's keys
        (``log_probs``, ``entropy``, ...), each nested over the full sequences. The default takes the dict as
        it is (verl's convention), but for the routes recorded under router replay's R2 (``routed_experts``, nested
        per sample: :attr:`OutputsView.routes`); an engine returning another shape or other names maps it here."""
        per_sequence = dict(outputs)
        routes = per_sequence.pop(ROUTES_SWITCH, None)
        return OutputsView(per_sequence, routes=None if routes is None else list(
            routes.unbind() if isinstance(routes, torch.Tensor) else routes))

    def repro_snippet(self, settings: Mapping[str, Any]) -> ReproSnippet | None:
        """How a standalone reproducer builds this engine for ``settings`` (:class:`ReproSnippet`), or None
        where it cannot (an engine object only a live process can rebuild). The default rebuilds the engine
        under test from its :meth:`recipe` by import and goes through the adapter's own views, so it
        imports the adapter (``standalone=False``); an adapter whose engine can be called without it
        (impl, verl's FSDP engine) writes the calls out instead."""
        build, args = self.recipe()
        module, name = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
        if build is _itself or not module or "<" in name or "." in name:
            return None
        try:
            literal = repr(tuple(args))
            eval(literal, {})  # noqa: S307 - only literals may be written into the file
        except Exception:  # noqa: BLE001 - arguments that are not literals: not reproducible by import
            return None
        code = "\n".join([f"from {module} import {name} as _build", f"_ENGINE = _build(*{literal})", "",
                          source("spec.protocol.adapter_repro")])
        return ReproSnippet(code, requires=module.split(".")[0], standalone=False)

    def __repr__(self) -> str:
        return f"<engine {self.name}>"


# -- the consumers' views of per-token outputs, and back --------------------------------------------------------

def _flag_width(micro_batch: Any, response_lens: torch.Tensor) -> int:
    width = micro_batch.get("max_response_len") if "max_response_len" in micro_batch.keys() else None
    width = getattr(width, "data", width)
    return int(width) if width is not None else int(response_lens.max())


def _lengths(micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, the full sequence length and the response length (int64, on the ids' device)."""
    ids = micro_batch["input_ids"]
    seq = ids.offsets().diff()
    resp = micro_batch["responses"].offsets().diff().to(seq.device)
    return seq, resp


def _response_index(seq: torch.Tensor, resp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every response token (sample-major): its sample, its column in the response and the packed position
    whose output scores it (``e_i - r_i - 1 + j``)."""
    ends = seq.cumsum(0)
    rows = torch.repeat_interleave(torch.arange(seq.shape[0], device=seq.device), resp)
    starts = resp.cumsum(0) - resp
    cols = torch.arange(int(resp.sum()), device=seq.device) - starts[rows]
    return rows, cols, (ends - resp - 1)[rows] + cols


def response_view(per_token: torch.Tensor, micro_batch: Any, width: int | None = None) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """What every framework's consumer reads of a per-token output: ``(B, R, *)`` values, row i holding at column j
    the output that scores response token j (the packed position ``e_i - r_i - 1 + j``: one to the left), exact
    zeros past ``r_i``, and the ``(B, R)`` bool mask of the real columns. ``R`` is ``width``, else the
    ``max_response_len`` flag, else ``max r_i``.

    It is verl's ``no_padding_2_padding`` slice, TRL's completion-only log-probs (``logits_to_keep`` =
    the completion width; ``completion_mask`` is the mask) and OpenRLHF's action slice (``log_probs[:, -num_actions:]``
    of the left-padded rows; ``action_mask`` is the mask): the three agree on every real column."""
    seq, resp = _lengths(micro_batch)
    width = _flag_width(micro_batch, resp) if width is None else int(width)
    values = per_token.values() if per_token.is_nested else per_token
    rows, cols, at = _response_index(seq.to(values.device), resp.to(values.device))
    keep = cols < width
    out = values.new_zeros((seq.shape[0], width, *values.shape[1:]))
    out[rows[keep], cols[keep]] = values[at[keep]]
    mask = torch.arange(width, device=values.device).unsqueeze(0) < resp.to(values.device).unsqueeze(1)
    return out, mask


#: TRL's completion-only per-token log-probs (``logits_to_keep``) and ``completion_mask``: :func:`response_view`
completion_view = response_view
#: OpenRLHF's action log-probs (``log_probs[:, -num_actions:]``) and ``action_mask``: :func:`response_view`
action_view = response_view


def sequences_from_responses(padded: torch.Tensor, micro_batch: Any, fill: float = float("nan")) -> torch.Tensor:
    """The inverse of :func:`response_view` for an engine whose outputs exist only where a response token is scored
    (:attr:`OutputSpan.RESPONSE`: TRL's completion log-probs, OpenRLHF's action log-probs, ``(B, R, *)`` right-padded):
    a nested tensor over the full sequences holding them at ``e_i - r_i - 1 .. e_i - 2`` and ``fill`` everywhere
    else (positions no consumer reads, never checked)."""
    seq, resp = _lengths(micro_batch)
    rows, cols, at = _response_index(seq.to(padded.device), resp.to(padded.device))
    if padded.dim() < 2 or padded.shape[0] != seq.shape[0] or padded.shape[1] < int(resp.max()):
        raise ValueError(f"sequences_from_responses: padded responses of shape {tuple(padded.shape)}, expected "
                         f"({seq.shape[0]}, >= {int(resp.max())}, ...)")
    values = padded.new_full((int(seq.sum()), *padded.shape[2:]), fill)
    values[at] = padded[rows, cols]
    return torch.nested.nested_tensor_from_jagged(values, micro_batch["input_ids"].offsets().to(padded.device))


def sequences_from_rows(rows: torch.Tensor, micro_batch: Any, layout: "PaddedLayout | str" = PaddedLayout.RIGHT
                        ) -> torch.Tensor:
    """Dense per-token rows ``(B, L, *)`` of a padded ``layout`` as a nested tensor over the full sequences (each
    sample's tokens in order, wherever the layout puts them: :func:`spec.protocol.profile.token_columns`)."""
    seq, resp = _lengths(micro_batch)
    sample, column, _ = token_columns(layout, seq - resp, resp, rows.device)
    return torch.nested.nested_tensor_from_jagged(rows[sample, column], micro_batch["input_ids"].offsets().to(rows.device))


# -- the contract's flags, read strictly (for adapters) ---------------------------------------------------------

#: every per-batch flag of the contract and its default (``max_response_len``: None = ``max r_i``)
FLAG_DEFAULTS: dict[str, Any] = {
    "use_remove_padding": True, "pad_mode": "no_padding", "use_fused_kernels": False, "pad_token_id": 0,
    "calculate_entropy": False, "calculate_sum_pi_squared": False, "distillation_use_topk": False,
    "distillation_only": False, "max_response_len": None, "temperature": 1.0,
}


def _plain_flag(micro_batch: Any, key: str) -> Any:
    if key not in micro_batch.keys():
        return FLAG_DEFAULTS[key]
    value = micro_batch.get(key)
    return getattr(value, "data", value) if type(value).__name__ == "NonTensorData" else value


def _is_bool(value: Any) -> bool:
    """A Python bool or a numpy bool (``numpy.bool_``, named ``bool`` in numpy 2)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def _as_int(key: str, value: Any) -> int:
    if _is_bool(value) or not (
            isinstance(value, int) or type(value).__module__ == "numpy" and "int" in type(value).__name__):
        raise TypeError(f"flag {key} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def read_flags(micro_batch: Any) -> dict[str, Any]:
    """The contract's flags of ``micro_batch`` as plain Python values, defaults filled in, read strictly: a bool flag
    is a bool, a numpy bool or a 0/1 int; ``pad_token_id`` an int (not a bool); ``max_response_len`` an int >= 1 or
    absent; ``pad_mode`` a str (or a str Enum: its value); ``temperature`` a float or a ``(B,)`` tensor. Anything
    else raises (TypeError, or ValueError for an impossible value) naming the flag: never a silently different run
    (INV-FLAG-001..003). For adapters whose engine takes its flags as arguments."""
    out: dict[str, Any] = {}
    for key, default in FLAG_DEFAULTS.items():
        value = _plain_flag(micro_batch, key)
        if isinstance(default, bool):
            if _is_bool(value):
                out[key] = bool(value)
                continue
            if _as_int(key, value) not in (0, 1):
                raise ValueError(f"flag {key} must be a bool (or 0/1), got {value!r}")
            out[key] = bool(value)
        elif key == "pad_token_id":
            out[key] = _as_int(key, value)
        elif key == "max_response_len":
            out[key] = None if value is None else _as_int(key, value)
            if out[key] is not None and out[key] < 1:
                raise ValueError(f"flag max_response_len must be >= 1, got {value!r}")
        elif key == "pad_mode":
            value = getattr(value, "value", value)
            if not isinstance(value, str):
                raise TypeError(f"flag pad_mode must be a str, got {type(value).__name__} {value!r}")
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        else:
            raise TypeError(f"temperature must be a float or a (B,) tensor, got {type(value).__name__} {value!r}")
    return out
