"""An engine's profile: everything the suite may assume about one engine, declared in one record.

PyTorch's OpInfo keeps everything about an op in one record; an engine's :class:`EngineProfile` does the same
for an engine under test (``EngineUnderTest.profile``):

* ``modes``: the modes it runs (``"packed"``, ``"padded"``); a target of a mode it does not run is a skip with
  the profile's reason, never the engine's failure;
* ``padded_layouts``: where each padded row's tokens sit (:class:`PaddedLayout`; :func:`layout_starts` is the one
  map from a layout and the lengths to each row's columns); the engine's padded input is in the first;
* ``positions``: the position kinds it accepts (``"rope"``: ``(B, n)``; ``"mrope"``: ``(4, B, n)``); the strategies
  draw only these;
* ``media``: the media kinds (``"image"``, ``"video"``, ``"audio"``) the engine hands its model from a micro-batch's
  ``multi_modal_inputs`` (docs/contract.md, "Images and videos", "Audio"); the strategies draw media cases (images
  and videos: mRoPE positions from the grids, features per sample; audio clips: 1-D positions, a Qwen2-Audio-style
  model's) only for these; default none;
* ``media_marks``: the marks of the media tokens its model reads to place the features (VeOmni's ``image_mask`` and
  ``video_mask``): every rank hands each with a media micro-batch (INV-MM-001), default none (a model placing them by
  the ids' media token ids);
* ``media_modes``: the modes in which it takes them (default both; a library that refuses to pack a vision-language
  batch, as TRL's trainers do, lists ``("padded",)``): media cases are drawn only in these, and a target comparing
  both modes draws none unless both are listed;
* ``mrope_modes``: the same for mRoPE positions (default both; SkyRL's vision-language model, the only one of its
  models taking mRoPE positions, refuses packing: ``("padded",)``);
* ``routes_modes``: the modes in which it replays an MoE rollout's routed experts where its configuration draws them
  (default both; VeOmni's engine refuses router replay without packing: ``("packed",)``): INV-ROUTE-001 is skipped,
  with this reason and ``routes_note``, in the others;
* ``tail_multiple``: the packed row is padded at its tail to a multiple of this many tokens (None: no rule); the
  packed invariants read the tail as padding (:func:`spec.truth.rules.padded_length`);
* ``contexts``: the execution contexts its callers run the preparation in (:data:`CONTEXTS`: the autograd modes,
  and ``autocast_bf16``, a caller's ``torch.autocast("cpu", dtype=torch.bfloat16)``); the strategies draw only
  these, and under an autocast the value invariants judge the scaled logits at the autocast's dtype;
* ``conventions``: what the engine promises beyond the contract (:class:`Convention`): checked for this engine
  only, never asserted of an engine that does not declare it;
* ``surface``: the engine's own preparation code (``package.module`` or ``package.module:function``), whose
  lines and branches ``spec verify`` measures with coverage.py;
* ``unreachable``: branches of the surface no CPU run can reach, each with its reason (``"module:line"`` ->
  ``"needs CUDA"``);
* ``reach_cases``: the engine's own pinned cases (``spec.cases.EngineCase``s with its switches set), run by every
  engine-case invariant beside the generated ones, as the suite's reach cases are (spec.run.runner): switch values
  the draws combine with a rare input only by chance (TRL's vision families, drawn on one case in fifteen: an
  image batch);
* ``refuses``: settings the engine declares it does not support (names of
  ``spec.invariants.settings.REFUSALS`` -> why); INV-FLAG-004/005 hand it each and assert an exception, never
  tensors (an engine that declares none is not asked);
* ``off_path``: what inside the surface's entries the preparation never passes through, -> why: a function
  (``"module:qualname"``: a helper only other models call, a debugging repr) or one branch of an on-path function
  (``"module:LINE->DEST"``, ``"module:LINE"`` for every exit of the line, the keys ``unreachable`` takes: an exit only a
  caller outside the preparation takes): not counted, nothing in them mutated, listed in the report with their
  reasons (a key that names no function or branch of the surface is listed as not found);
* ``metrics``: outputs the engine computes as metrics only (under ``torch.no_grad()``: an entropy it logs, never an
  entropy bonus a loss differentiates): INV-GRAD-001 then asserts no gradient flows through them (detached from the
  graph in the policy update, so no loss can backpropagate through a metric by mistake); their values are checked
  as any output's;
* ``model_computes_positions``: the engine hands the model no ``position_ids`` (a RoPE model computes them from its
  cache positions, ``arange`` over each row; the stand-in model then sees each row's tokens at their positions
  from the first attended one, as relative RoPE does): the position checks assert none is handed (a handed one is
  still checked), never a position the engine does not hand. Only a padded batch can run so: a packed row's
  boundaries are in its positions (declared with ``"packed"`` in ``modes``, or ``"mrope"`` positions, it is an error);
* ``equivalent_mutants``: mutants of the surface (``spec mutate``, by their stable id) that no input tells from the
  engine's own code, each with the reason;
* ``output_span``: which positions of each sequence its per-token outputs cover (:class:`OutputSpan`: every token,
  or only those that score a response token);
* ``head_input``: what the model hands its output step (:class:`HeadInput`: logits, or hidden states and the LM-head
  weight);
* ``config_space``: the switches of the engine's own configuration that change its preparation's path
  (:class:`ConfigSwitch`), each drawn like any other dimension of a case;
* ``per_sample_temperature``: whether it takes one temperature per sample (a ``(B,)`` tensor); False: one per
  trainer, every case draws one float and the engine lacks :attr:`Feature.PER_SAMPLE_TEMPERATURE`.

:class:`Feature` names what an invariant may need of an engine (what its profile and probes offer).

This module imports nothing from ``spec`` (tests/test_layering.py): the protocol layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

import torch

__all__ = ["Convention", "EngineProfile", "OutputSpan", "HeadInput", "Feature", "ConfigSwitch", "DEFAULT_PROFILE", "MODES",
           "POSITIONS", "MEDIA", "VISION", "MEDIA_INPUT_KEYS", "AUDIO_INPUT_KEYS", "CONTEXTS", "AUTOGRAD_CONTEXTS", "AUTOCAST_DTYPES", "PaddedLayout",
           "layout_starts", "token_columns", "profile_of", "ROUTES_SWITCH", "ROUTES_RECORDED", "routes_dtype", "routes_recorded", "padded_layout_of", "tail_multiple_of", "VERL_CONVENTIONS", "METRIC_OUTPUTS",
           "takes_mode", "drawn_config", "equivalents_on"]

#: the two ways a trainer feeds the model
MODES = ("packed", "padded")
#: the position kinds: 1-D rotary positions, or Qwen2-VL's 4-axis mRoPE positions
POSITIONS = ("rope", "mrope")
#: the media a micro-batch carries: a vision-language model's images and videos (spec.truth.vision), an audio
#: model's clips (spec.truth.audio)
MEDIA = ("image", "video", "audio")
#: the kinds a vision-language model reads (mRoPE positions from their grids)
VISION = ("image", "video")
#: per media kind, the keys of its features and its grids, in a sample's ``multi_modal_inputs`` entry and in the
#: model's inputs (a Qwen2-VL processor's and model's names)
MEDIA_INPUT_KEYS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
#: an audio clip's keys: its log-mel features ``(clips, mels, frames)`` and which frames are the clip's
#: ``(clips, frames)`` (a Whisper feature extractor's, Qwen2-Audio's and Qwen2.5-Omni's names; verl's
#: ``_VARLEN_MULTI_MODAL_KEYS``)
AUDIO_INPUT_KEYS = ("input_features", "feature_attention_mask")
#: the autograd contexts a trainer calls the preparation in (the policy update; the old-policy and reference passes)
AUTOGRAD_CONTEXTS = ("grad", "no_grad", "inference_mode")
#: each autocast context and the dtype its lower-precision ops compute in (grad enabled, as a policy update runs)
AUTOCAST_DTYPES = {"autocast_bf16": "bfloat16"}
#: every execution context an engine's profile may list
CONTEXTS = AUTOGRAD_CONTEXTS + tuple(AUTOCAST_DTYPES)
#: the outputs an engine may declare metrics only (``EngineProfile.metrics``): logged, never differentiated
METRIC_OUTPUTS = ("entropy", "sum_pi_squared")


def _target_modes(mode: str) -> tuple[str, ...]:
    """The modes a target of ``mode`` runs: both for ``both`` (one comparing the two), ``mode`` itself for
    ``packed``/``padded``, none for another (``any``: the mode left to the draw)."""
    return MODES if mode == "both" else (mode,) if mode in MODES else ()


def takes_mode(mode: str, *, mrope: bool = False, media: bool = False, modes: tuple[str, ...] = MODES,
               mrope_modes: tuple[str, ...] = MODES, media_modes: tuple[str, ...] = MODES) -> bool:
    """The one rule of whether an engine takes a case in ``mode`` (``packed``, ``padded``, or ``both``: a target
    that compares the two, or leaves the mode to the draw, needs both): a mode it runs (``modes``), and, for a case
    with mRoPE positions or with images and videos, a mode it takes those in (``mrope_modes``, ``media_modes``: a
    vision-language library that refuses to pack). :meth:`EngineProfile.takes` applies it to a profile; the
    strategies, which carry a profile's limits as plain values, call it with those."""
    wanted = MODES if mode == "both" else (mode,)
    return all(m in modes and (not mrope or m in mrope_modes) and (not media or m in media_modes) for m in wanted)


class Feature(str, Enum):
    """What an invariant may need from an engine (``InvariantInfo.needs`` holds the values)."""

    #: the engine object itself: prepare_model_inputs / prepare_model_outputs on a micro-batch
    ENGINE = "engine"
    SP = "sp"  # sequence parallelism (sp_size, sp_rank, all_gather settings)
    BUCKET = "bucket"  # static pad_to_length bucket
    #: a tail rule of its own: the packed row padded at its tail to a multiple (the profile's ``tail_multiple``, or
    #: a switch of its configuration that sets one: ``ConfigSwitch.tail_multiple``)
    TAIL_RULE = "tail_rule"
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
    #: one temperature per sample (a ``(B,)`` tensor); an engine with one temperature per trainer lacks it
    #: (its profile's ``per_sample_temperature=False``): every invariant then uses one shared value
    PER_SAMPLE_TEMPERATURE = "per_sample_temperature"
    BUILD_ATTENTION_MASK = "build_attention_mask_from_nested"
    NO_PADDING_2_PADDING = "no_padding_2_padding"
    LEFT_RIGHT_2_NO_PADDING = "left_right_2_no_padding"
    RESPONSE_FROM_NESTED = "response_from_nested"
    RESPONSE_TO_NESTED = "response_to_nested"
    #: the micro-batch layer before prepare_model_inputs and after prepare_model_outputs (verl's
    #: prepare_micro_batches, seqlen balancing, tensordict utilities): spec.protocol.microbatch
    MICROBATCH = "microbatch"
    #: images and videos: the engine hands its model a micro-batch's ``multi_modal_inputs`` (its profile's ``media``)
    MEDIA = "media"
    #: audio clips: the engine hands an audio model a micro-batch's ``multi_modal_inputs`` (``"audio"`` in its
    #: profile's ``media``)
    AUDIO = "audio"
    #: MoE router replay: the rollout's routed experts handed on per token (a switch of its configuration named
    #: :data:`ROUTES_SWITCH` collates them: the micro-batch then carries ``routed_experts``)
    ROUTES = "routes"
    #: MoE router replay's record (R2): the routers' own routes recorded and returned per sample (the switch
    #: :data:`ROUTES_SWITCH` has the value :data:`ROUTES_RECORDED`)
    ROUTES_RECORD = "routes_record"

    @classmethod
    def parse(cls, name: "str | Feature") -> "Feature":
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown feature {name!r}; features: {[f.value for f in cls]}") from None


class PaddedLayout(str, Enum):
    """Where a padded engine (``use_remove_padding=False``) puts each sequence in its ``(B, L)`` model input: each
    row's tokens are contiguous and in order, from the row's start column (:func:`layout_starts`, the one map from a
    layout to columns that the harness's poisoning, the mask/row invariants and :func:`~spec.protocol.engine.
    sequences_from_rows` read)."""

    #: verl: the whole sequence from column 0, right-padded to ``L = max n_i``
    RIGHT = "right"
    #: what Hugging Face ``generate`` returns (TRL, OpenRLHF): each prompt left-padded to ``P = max p_i`` (it ends
    #: at column ``P - 1``), each response from column ``P``, right-padded to ``L = P + max r_i``
    LEFT_RIGHT = "left_right"
    #: every row right-aligned (SkyRL, OpenRLHF-style left-padded rows): padding on the left, each sequence ending at
    #: the last column ``L - 1`` with ``L = max n_i``
    LEFT = "left"


def layout_starts(layout: "PaddedLayout | str", prompt_lens: Any, response_lens: Any
                  ) -> tuple[torch.Tensor, int]:
    """Each row's first column (int64, ``(B,)``) and the width ``L`` of the padded input in ``layout``: row i holds
    its ``n_i = p_i + r_i`` tokens at columns ``start_i .. start_i + n_i - 1``. The one statement of what a layout
    means (lengths as sequences of ints or int tensors)."""
    prompts = torch.as_tensor(prompt_lens, dtype=torch.int64).reshape(-1).cpu()
    responses = torch.as_tensor(response_lens, dtype=torch.int64).reshape(-1).cpu()
    lens = prompts + responses
    layout = PaddedLayout(layout)
    if layout is PaddedLayout.RIGHT:
        return torch.zeros_like(lens), int(lens.max())
    if layout is PaddedLayout.LEFT:
        width = int(lens.max())
        return width - lens, width
    width = int(prompts.max())
    return width - prompts, width + int(responses.max())


def token_columns(layout: "PaddedLayout | str", prompt_lens: Any, response_lens: Any,
                  device: "torch.device | str" = "cpu") -> tuple[torch.Tensor, torch.Tensor, int]:
    """For every token of the batch (sample-major, each sample's tokens in order): its row and its column in the
    padded input of ``layout`` (int64, on ``device``), and the width ``L`` (:func:`layout_starts`)."""
    starts, width = layout_starts(layout, prompt_lens, response_lens)
    lens = (torch.as_tensor(prompt_lens, dtype=torch.int64).reshape(-1).cpu()
            + torch.as_tensor(response_lens, dtype=torch.int64).reshape(-1).cpu())
    rows = torch.repeat_interleave(torch.arange(lens.shape[0]), lens)
    within = torch.arange(int(lens.sum())) - (lens.cumsum(0) - lens)[rows]
    return rows.to(device), (starts[rows] + within).to(device), width


class OutputSpan(str, Enum):
    """Which positions of each sequence an engine's per-token outputs cover (what a consumer reads is always
    the response slice; the last token of a sequence scores nothing and is read by no consumer)."""

    #: every token of the full sequence (verl's nested outputs): positions ``0 .. n_i - 2`` are checked
    SEQUENCE = "sequence"
    #: only the positions that score a response token (TRL's completion-only log-probs with ``logits_to_keep``,
    #: OpenRLHF's action-mask slice): ``p_i - 1 .. n_i - 2``; :func:`sequences_from_responses` builds them
    RESPONSE = "response"


class HeadInput(str, Enum):
    """What the stand-in model hands the engine's output step."""

    LOGITS = "logits"  # ``output.logits`` (R, n, V)
    #: the fused-head protocol: ``output.hidden_states`` (R, n, H) and ``output.lm_head_weight`` (V, H), both in
    #: the logits' dtype; the logits are ``hidden_states.float() @ lm_head_weight.float().T`` (exact in float32),
    #: for engines that compute log-probs from hidden states (TRL ``add_fused_lm_head``, Liger, fused kernels)
    HIDDEN = "hidden"


class Convention(str, Enum):
    """What one engine promises beyond the contract (docs/contract.md, "Conventions"). The contract asserts what
    every consumer reads; a convention is asserted only of an engine whose profile declares it."""

    #: the padded ``attention_mask`` is int32 (verl); the contract asks only for 0/1 values of an integer or bool dtype
    INT32_ATTENTION_MASK = "int32_attention_mask"
    #: padding columns of ``position_ids`` hold 0 (verl); the contract leaves them to the engine (no consumer reads them)
    PADDING_POSITION_ZERO = "padding_position_zero"
    #: the packed boundaries are also handed as a host copy, ``cu_seqlens_cpu`` (verl)
    CU_SEQLENS_HOST_COPY = "cu_seqlens_host_copy"
    #: the model's logits are left as they were, even where no caller reads them again (verl); the contract only
    #: forbids changing what a caller still reads (its micro-batch, its own tensors)
    LOGITS_UNTOUCHED = "logits_untouched"


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
    #: the positions the engine's outputs cover when the switch is drawn off its default (OpenRLHF's ``action_mask``:
    #: ``OutputSpan.RESPONSE``), where it changes them (:meth:`EngineUnderTest.output_span_of`); None: it does not
    output_span: "OutputSpan | None" = None
    #: the layout of the engine's padded model input when the switch is drawn off its default (TRL's SFT collator:
    #: whole sequences right-padded, ``PaddedLayout.RIGHT``), one of the profile's ``padded_layouts``
    #: (:meth:`EngineUnderTest.padded_layout_of`); None: it does not change it
    padded_layout: "PaddedLayout | None" = None
    #: True where the drawn value is the multiple the engine pads its packed row to at the tail (TRL's SFT
    #: ``pad_to_multiple_of``): the case's tail rule (:func:`tail_multiple_of`), in place of the profile's
    #: ``tail_multiple``, wherever the switch is drawn off its default
    tail_multiple: bool = False

    def __post_init__(self) -> None:
        if self.setting is None and not self.values:
            raise ValueError(f"config switch {self.name!r} draws no value (give values, or the setting it is drawn as)")
        for need in self.needs:
            Feature.parse(need)


#: what verl's FSDP engine (and impl, its drop-in) promises beyond the contract: all four conventions
VERL_CONVENTIONS: frozenset[Convention] = frozenset(Convention)


@dataclass(frozen=True)
class EngineProfile:
    """What one engine is (see the module docstring). The default is verl's FSDP engine without its conventions:
    both modes, right-aligned padded rows, both position kinds, no tail rule, every autograd context."""

    modes: tuple[str, ...] = MODES
    padded_layouts: tuple[PaddedLayout, ...] = (PaddedLayout.RIGHT,)
    positions: tuple[str, ...] = POSITIONS
    media: tuple[str, ...] = ()
    media_modes: tuple[str, ...] = MODES
    #: the marks of the media tokens its model reads to place the features (``MEDIA_TOKEN_MARKS``: VeOmni's VL models
    #: place them at ``image_mask`` / ``video_mask``), which every rank must hand with a media micro-batch (INV-MM-001)
    media_marks: tuple[str, ...] = ()
    routes_modes: tuple[str, ...] = MODES
    #: why router replay is not run in the modes ``routes_modes`` leaves out (the skip reason says it), where the
    #: engine has them but the suite runs them elsewhere (verl Megatron's BSHD: a finding with its own reproducer)
    routes_note: str = ""
    mrope_modes: tuple[str, ...] = MODES
    tail_multiple: int | None = None
    contexts: tuple[str, ...] = AUTOGRAD_CONTEXTS
    conventions: frozenset[Convention] = frozenset()
    surface: tuple[str, ...] = ()
    unreachable: Mapping[str, str] = field(default_factory=dict)
    off_path: Mapping[str, str] = field(default_factory=dict)
    refuses: Mapping[str, str] = field(default_factory=dict)
    equivalent_mutants: Mapping[str, str] = field(default_factory=dict)
    metrics: frozenset[str] = frozenset()
    model_computes_positions: bool = False
    output_span: OutputSpan = OutputSpan.SEQUENCE
    head_input: HeadInput = HeadInput.LOGITS
    config_space: tuple[ConfigSwitch, ...] = ()
    per_sample_temperature: bool = True
    reach_cases: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"profile modes: unknown mode {mode!r}; modes: {MODES}")
        if not self.modes:
            raise ValueError("profile modes: an engine runs at least one mode")
        for kind in self.positions:
            if kind not in POSITIONS:
                raise ValueError(f"profile positions: unknown kind {kind!r}; kinds: {POSITIONS}")
        if not self.positions:
            raise ValueError("profile positions: an engine accepts at least one position kind")
        for kind in self.media:
            if kind not in MEDIA:
                raise ValueError(f"profile media: unknown kind {kind!r}; kinds: {MEDIA}")
        for name, kind in (("media_modes", self.media), ("mrope_modes", "mrope" in self.positions),
                           ("routes_modes", True)):
            value = getattr(self, name)
            if kind and not set(value) & set(self.modes) or not set(value) <= set(MODES):
                raise ValueError(f"profile {name} {value!r}: modes of {MODES}, one of them among the engine's modes "
                                 f"{self.modes!r}")
        if set(self.media) & set(VISION) and "mrope" not in self.positions:
            raise ValueError("profile media: a vision-language engine takes mRoPE positions (positions has no 'mrope')")
        if "audio" in self.media and "rope" not in self.positions:
            raise ValueError("profile media: an audio model takes 1-D positions (positions has no 'rope')")
        if not self.padded_layouts:
            raise ValueError("profile padded_layouts: name at least one (the engine's padded input is in the first)")
        object.__setattr__(self, "padded_layouts", tuple(PaddedLayout(layout) for layout in self.padded_layouts))
        for context in self.contexts:
            if context not in CONTEXTS:
                raise ValueError(f"profile contexts: unknown context {context!r}; contexts: {CONTEXTS}")
        if not self.contexts:
            raise ValueError("profile contexts: callers run the preparation in at least one context")
        if self.tail_multiple is not None and self.tail_multiple < 1:
            raise ValueError(f"profile tail_multiple must be >= 1 or None, got {self.tail_multiple!r}")
        object.__setattr__(self, "conventions", frozenset(Convention(c) for c in self.conventions))
        object.__setattr__(self, "metrics", frozenset(self.metrics))
        for key in self.metrics:
            if key not in METRIC_OUTPUTS:
                raise ValueError(f"profile metrics: {key!r} cannot be a metric only; outputs that may: {METRIC_OUTPUTS}")
        if self.model_computes_positions and ("packed" in self.modes or "mrope" in self.positions):
            raise ValueError("profile model_computes_positions: a model computes rope positions of a padded batch "
                             "only (a packed row's sequence boundaries, and mRoPE's axes, are in the positions the "
                             f"engine hands): declare modes=('padded',) and positions=('rope',), got modes="
                             f"{self.modes!r}, positions={self.positions!r}")
        object.__setattr__(self, "output_span", OutputSpan(self.output_span))
        object.__setattr__(self, "head_input", HeadInput(self.head_input))

    def runs(self, mode: str) -> bool:
        return mode in self.modes

    def takes(self, mode: str, *, mrope: bool = False, media: bool = False) -> bool:
        """Whether the engine takes a case in ``mode`` (or ``both``), with mRoPE positions and with media as
        asked (:func:`takes_mode`: the one rule every caller applies)."""
        return takes_mode(mode, mrope=mrope, media=media, modes=self.modes, mrope_modes=self.mrope_modes,
                          media_modes=self.media_modes)

    @property
    def padded_layout(self) -> PaddedLayout:
        """The layout of the engine's padded model input (the first of :attr:`padded_layouts`)."""
        return self.padded_layouts[0]

    def mode_reason(self, mode: str) -> str | None:
        """Why a target of ``mode`` (``packed``, ``padded``, ``both``: one comparing the two) does not apply to this
        engine, or None."""
        wanted = _target_modes(mode)
        missing = [m for m in wanted if m not in self.modes]
        if not missing:
            return None
        return (f"the engine runs only the {' and '.join(self.modes)} mode (its profile: modes={self.modes!r}); "
                f"no {' or '.join(missing)} run to check")

    def position_reason(self, kind: str) -> str | None:
        """Why cases with positions of ``kind`` (``rope``, ``mrope``) are not drawn for this engine, or None."""
        if kind in self.positions:
            return None
        return f"the engine takes {' and '.join(self.positions)} positions only (its profile: positions={self.positions!r})"

    def media_reason(self, kind: str) -> str | None:
        """Why cases carrying ``kind`` (``image``, ``video``) are not drawn for this engine, or None."""
        if kind in self.media:
            return None
        return (f"the engine hands its model no {kind}s from multi_modal_inputs (its profile: media={self.media!r})")

    def media_mode_reason(self, mode: str) -> str | None:
        """Why a target of ``mode`` (``packed``, ``padded``, ``both``: one comparing the two) draws no images or
        videos, or None (an engine without media: :meth:`media_reason`)."""
        wanted = _target_modes(mode)
        allowed = [m for m in MODES if self.takes(m, mrope=True, media=True)]
        missing = [m for m in wanted if self.runs(m) and not self.takes(m, mrope=True, media=True)]
        if not self.media or not missing:
            return None
        return (f"the engine takes images and videos in the {' and '.join(allowed)} mode only (its profile: "
                f"media_modes={self.media_modes!r}, mrope_modes={self.mrope_modes!r}); no {' or '.join(missing)} run "
                "with media")

    def routes_mode_reason(self, mode: str) -> str | None:
        """Why a target of ``mode`` (``packed``, ``padded``, ``both``) hands on no routed experts, or None: a mode
        the engine never runs router replay in (its profile's ``routes_modes``; an engine without the switch:
        :meth:`~spec.protocol.engine.EngineUnderTest.lacks`)."""
        wanted = _target_modes(mode)
        missing = [m for m in wanted if self.runs(m) and m not in self.routes_modes]
        if not missing:
            return None
        return (f"the engine replays routed experts in the {' and '.join(self.routes_modes)} mode only (its profile: "
                f"routes_modes={self.routes_modes!r}); no {' or '.join(missing)} run with routes"
                + (f": {self.routes_note}" if self.routes_note else ""))

    def context_reason(self, context: str) -> str | None:
        """Why cases in execution ``context`` are not drawn for this engine, or None."""
        if context in self.contexts:
            return None
        return f"the engine's callers do not run it in {context} (its profile: contexts={self.contexts!r})"

    def promises(self, convention: "Convention | str") -> bool:
        return Convention(convention) in self.conventions


DEFAULT_PROFILE = EngineProfile()


#: the switch of an engine's configuration that has it collate the rollout's routed experts (MoE router replay, R3),
#: its values the routes' dtype (``spec.truth.routes.ROUTE_DTYPES``): drawn on, the micro-batch carries each sample's
#: ``routed_experts`` (spec.cases.materialize) and INV-ROUTE-001 reads what the engine hands on (``InputsView.routes``)
ROUTES_SWITCH = "routed_experts"


def equivalents_on(declared: Mapping[str, str], surface: tuple[str, ...]) -> dict[str, str]:
    """The equivalent-mutant declarations of ``declared`` (keyed by ``spec.mutate.Mutant.id``, ``module:function:LINE
    operator: ...``) whose mutant lies on ``surface`` (an entry naming its ``module:function``, or its whole module):
    what an engine that shares functions with another takes of that engine's declarations."""
    out: dict[str, str] = {}
    for key, why in declared.items():
        site = key.split(" ", 1)[0].rsplit(":", 1)[0]
        if site in surface or site.partition(":")[0] in surface:
            out[key] = why
    return out


#: the value of :data:`ROUTES_SWITCH` that has the engine record the routes instead (R2's ``compute_log_prob``: the
#: MoE routers route on their own, their routes are recorded and returned as the output ``routed_experts``, per
#: sample; the micro-batch carries none): INV-ROUTE-002 reads the record (``OutputsView.routes``)
ROUTES_RECORDED = "record"


def routes_dtype(case: Any) -> str | None:
    """The dtype of the rollout's routes ``case`` carries (its :data:`ROUTES_SWITCH` drawn to a dtype), or None (off,
    or drawn to :data:`ROUTES_RECORDED`: an R2 record, whose micro-batch carries no routes)."""
    value = drawn_config(case).get(ROUTES_SWITCH)
    return None if value == ROUTES_RECORDED else value


def routes_recorded(case: Any) -> bool:
    """Whether ``case`` has its engine record the MoE routers' own routes (:data:`ROUTES_RECORDED` drawn)."""
    return drawn_config(case).get(ROUTES_SWITCH) == ROUTES_RECORDED


def drawn_config(case: Any) -> dict[str, Any]:
    """The engine's own switches drawn for ``case`` (its ``engine_config``: switch name -> value, those off their
    defaults), ``{}`` for a case without any."""
    return dict(getattr(case, "engine_config", ()) or ())


def profile_of(engine: Any) -> EngineProfile:
    """``engine``'s profile (an object without one: :data:`DEFAULT_PROFILE`)."""
    return getattr(engine, "profile", None) or DEFAULT_PROFILE


def tail_multiple_of(engine: Any, case: Any) -> int | None:
    """The multiple ``engine`` pads its packed row to at the tail on ``case``: its ``tail_multiple_of(case)`` where it
    has one (a switch of its configuration drawn for the case may set it), else its profile's ``tail_multiple``."""
    of_case = getattr(engine, "tail_multiple_of", None)
    return of_case(case) if of_case is not None else profile_of(engine).tail_multiple


def padded_layout_of(engine: Any, case: Any) -> PaddedLayout:
    """The layout of ``engine``'s padded model input on ``case``: its ``padded_layout_of(case)`` where it has one (a
    switch of its configuration drawn for the case may change it), else its profile's."""
    layout_of = getattr(engine, "padded_layout_of", None)
    return PaddedLayout(layout_of(case)) if layout_of is not None else profile_of(engine).padded_layout
