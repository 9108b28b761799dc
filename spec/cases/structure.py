"""The structure of a test case: lengths, splits, flags, temperatures and a seed.

Cases hold no tensors. :mod:`spec.cases.materialize` makes the tensors from ``seed`` so
a failing case shrinks to a few small integers and prints as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..protocol.profile import CONTEXTS as EXECUTION_CONTEXTS
from ..protocol.profile import MEDIA
from ..truth.rules import TEMPERATURE_FLOOR
from ..truth.audio import AUDIO_STRIDE
from ..truth.vision import MERGE, MIN_MEDIA_VOCAB
from .topology import Topology

__all__ = ["Media", "media_fits", "SampleLengths", "EngineCase", "DenseCase", "DISTILLATION_KEYS", "LOGITS_DTYPES",
           "ROUTED_DTYPES", "TEMPERATURE_FLOOR", "CONTEXTS", "EXECUTION_CONTEXTS", "SMALL_VOCAB", "LONG_ROW"]

#: The size tiers' limits (spec/cases/strategies.py draws them, spec/cases/coverage.py reads a case's tier off them):
#: the small and long tiers' vocabularies are at most ``SMALL_VOCAB`` ids (both sides of 256); a wider one is the wide
#: tier's. A row of more than ``LONG_ROW`` tokens (a rotary table's, a 2,048-token buffer's edge) is the long tier's,
#: each side of its long sequence at most ``LONG_ROW`` tokens.
SMALL_VOCAB = 257
LONG_ROW = 2048
#: The dtypes a model may return its logits in.
LOGITS_DTYPES = ("float32", "bfloat16", "float16")
#: dtypes a router-replay routed_experts tensor comes in (int16: verl's agent loop; uint8 up to 256 experts)
ROUTED_DTYPES = ("int64", "int32", "int16", "uint8")

#: The autograd contexts a trainer calls the preparation in: the policy update (``grad``: grad enabled, the
#: model's logits require grad), the old-policy and reference log-prob passes (``no_grad``:
#: ``torch.no_grad()``; ``inference_mode``: ``torch.inference_mode()``). Cases shrink to ``grad``. The contexts
#: drawn for an engine are its profile's (default these); :data:`EXECUTION_CONTEXTS` adds a caller's autocast
#: (``autocast_bf16``), drawn only for an engine whose profile lists it.
CONTEXTS = ("grad", "no_grad", "inference_mode")

#: Keys the suite's top-K distillation processor can produce (verl's names).
DISTILLATION_KEYS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count",
                     "overlap_token_advantage")


class ModelSeed(int):
    """An ``int`` seed that also names the dtype the toy model returns its logits in."""

    logits_dtype: str

    def __new__(cls, value: int, logits_dtype: str = "float32") -> "ModelSeed":
        seed = super().__new__(cls, int(value))
        seed.logits_dtype = logits_dtype
        return seed

    def __repr__(self) -> str:
        return str(int(self))

    def __reduce__(self):
        return (ModelSeed, (int(self), self.logits_dtype))


@dataclass(frozen=True)
class Media:
    """One image, video or audio clip of a sample, as structure. An image or video: its grid of patches ``(t, h, w)``
    (``t = 1`` for an image; h and w multiples of :data:`~spec.truth.vision.MERGE`), taking ``t*h*w / MERGE**2``
    prompt tokens (:func:`spec.truth.vision.media_tokens`). An audio clip: its ``frames`` (at least
    :data:`~spec.truth.audio.AUDIO_STRIDE`), taking ``frames // AUDIO_STRIDE`` tokens (:mod:`spec.truth.audio`).
    ``gap``: the text tokens of the prompt between the previous item (or the prompt's start) and this one. Its features
    come from the case's seed (:mod:`spec.cases.materialize`). Prints as ``img1x2x4+1`` (kind, grid, gap) or
    ``aud5+1`` (frames, gap)."""

    kind: str = "image"
    t: int = 1
    h: int = 2
    w: int = 2
    gap: int = 0
    frames: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MEDIA:
            raise ValueError(f"media kind must be one of {MEDIA}, got {self.kind!r}")
        if self.gap < 0:
            raise ValueError(f"media gap must be >= 0, got {self.gap}")
        if self.kind == "audio":
            if self.frames < AUDIO_STRIDE:
                raise ValueError(f"audio frames={self.frames}: a clip has at least {AUDIO_STRIDE} (one token)")
            return
        if self.frames:
            raise ValueError(f"{self.kind} frames={self.frames}: only an audio clip has frames")
        if self.t < 1 or (self.kind == "image" and self.t != 1):
            raise ValueError(f"{self.kind} grid t={self.t}: an image has t = 1, a video t >= 1")
        if self.h < MERGE or self.w < MERGE or self.h % MERGE or self.w % MERGE:
            raise ValueError(f"{self.kind} grid h={self.h} w={self.w}: multiples of the merge size {MERGE}")

    @property
    def tokens(self) -> int:
        if self.kind == "audio":
            return self.frames // AUDIO_STRIDE
        return self.t * self.h * self.w // (MERGE * MERGE)

    @property
    def grid(self) -> tuple[int, ...]:
        return (self.frames,) if self.kind == "audio" else (self.t, self.h, self.w)

    def __repr__(self) -> str:
        if self.kind == "audio":
            return f"aud{self.frames}+{self.gap}"
        return f"{'img' if self.kind == 'image' else 'vid'}{self.t}x{self.h}x{self.w}+{self.gap}"


def media_fits(items: tuple[Media, ...], prompt_len: int) -> bool:
    """Whether a sample's media items (their gaps and tokens) fit in a prompt of ``prompt_len`` tokens."""
    return sum(m.gap + m.tokens for m in items) <= prompt_len


class SampleLengths:
    """Per-sample prompt and response lengths (``prompt_lens``, ``response_lens`` fields of the dataclass that
    mixes this in) and what derives from them; :meth:`_check_lengths` is its validation."""

    def _check_lengths(self) -> None:
        if len(self.prompt_lens) != len(self.response_lens) or not self.prompt_lens:
            raise ValueError(f"need equal, non-empty prompt/response lists: {self.prompt_lens} {self.response_lens}")
        if min(self.prompt_lens) < 1 or min(self.response_lens) < 0:
            raise ValueError("prompt lengths must be >= 1 and response lengths >= 0 (an aborted rollout's is 0)")

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(p + r for p, r in zip(self.prompt_lens, self.response_lens))

    @property
    def total_nnz(self) -> int:
        return sum(self.seq_lens)


@dataclass(frozen=True)
class EngineCase(SampleLengths):
    """One micro-batch and the engine configuration it runs under."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    vocab: int = 16
    #: one float (stored as a flag) or one value per sample (a ``(B,)`` tensor)
    temperature: float | tuple[float, ...] = 1.0
    mrope: bool = False
    use_remove_padding: bool = True
    calculate_entropy: bool = False
    calculate_sum_pi_squared: bool = False
    #: keys of the top-K distillation processor; empty = distillation off
    distillation_keys: tuple[str, ...] = ()
    distillation_only: bool = False
    use_fused_kernels: bool = False
    topk: int = 2
    pad_token_id: int = 0
    max_response_len: int | None = None
    sp_size: int = 1
    #: on real ranks, the SP groups' global ranks (spec.cases.topology); None: one group [0, sp_size)
    topology: Topology | None = None
    pad_to_length: int | None = None
    pass_cu_seqlens: bool = False
    entropy_chunk_size: int | None = None
    head: str = "lm"
    #: dtype of the model's logits (the contract's outputs are float32 whatever this is)
    logits_dtype: str = "float32"
    #: when set, every response ends with this token (pad == eos when it equals ``pad_token_id``)
    eos_token_id: int | None = None
    #: share of response tokens with loss_mask 0 (holes inside responses: multi-turn tool output)
    mask_hole_rate: float = 0.2
    seed: int = 0
    #: the execution context the engine's calls and the model run in (:data:`EXECUTION_CONTEXTS`)
    context: str = "grad"
    #: the engine's own configuration switches drawn off their defaults, ``((name, value), ...)`` (the adapter's
    #: ``config_space``); they reach the engine as ``make(head, **settings, name=value)``
    engine_config: tuple[tuple[str, object], ...] = ()
    #: per sample, its images and videos, or its audio clips (:class:`Media`, possibly none), in its prompt; ``()``: a
    #: text-only batch. A case with images or videos has mRoPE positions (Qwen2-VL's rope index of the grids), one with
    #: audio clips 1-D positions (Qwen2-Audio's); either has ``multi_modal_inputs``
    media: tuple[tuple[Media, ...], ...] = ()

    def __post_init__(self) -> None:
        # The model is built from (vocab, seed) alone (spec.execute.harness.model_for); the seed carries the
        # logits dtype to it. It stays an int everywhere else (hash, equality, repr).
        object.__setattr__(self, "seed", ModelSeed(self.seed, self.logits_dtype))
        if self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {self.logits_dtype!r}")
        if self.context not in EXECUTION_CONTEXTS:
            raise ValueError(f"context must be one of {EXECUTION_CONTEXTS}, got {self.context!r}")
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab})")
        self._check_lengths()
        if self.media:
            self._check_media()

    def _check_media(self) -> None:
        if len(self.media) != self.batch_size:
            raise ValueError(f"media for {len(self.media)} samples in a batch of {self.batch_size}")
        audio = self.has_audio
        if audio and any(item.kind != "audio" for items in self.media for item in items):
            raise ValueError("a case carries images and videos or audio clips, not both (an omni model's rope index "
                             "of audio beside images is not drawn)")
        if self.mrope == audio:
            raise ValueError("a case with images or videos has mRoPE positions (mrope=True), one with audio clips "
                             f"1-D positions (mrope=False); got mrope={self.mrope} with {list(self.media)}")
        if self.vocab < MIN_MEDIA_VOCAB:
            raise ValueError(f"a case with media needs vocab >= {MIN_MEDIA_VOCAB}, got {self.vocab}")
        for i, (items, p) in enumerate(zip(self.media, self.prompt_lens)):
            if not media_fits(items, p):
                raise ValueError(f"sample {i}: media {list(items)} take more than its prompt of {p} tokens")

    @property
    def has_media(self) -> bool:
        return any(self.media)

    @property
    def has_audio(self) -> bool:
        """Whether the case's media are audio clips (1-D positions), not images and videos."""
        return any(item.kind == "audio" for items in self.media for item in items)

    # -- derived structure (batch_size, seq_lens, total_nnz: SampleLengths) --------------------------
    @property
    def distillation_use_topk(self) -> bool:
        return bool(self.distillation_keys)

    @property
    def per_sample_temperature(self) -> bool:
        return isinstance(self.temperature, tuple)

    def temperatures(self) -> tuple[float, ...]:
        if isinstance(self.temperature, tuple):
            return self.temperature
        return (float(self.temperature),) * self.batch_size

    @property
    def response_width(self) -> int:
        return self.max_response_len if self.max_response_len is not None else max(self.response_lens)

    @property
    def mode(self) -> str:
        return "packed" if self.use_remove_padding else "padded"

    @property
    def split_view(self) -> bool:
        """One case in three (by its seed) hands its nested tensors as views into a bigger buffer, as a micro-batch
        split or sliced from a trainer's mini-batch arrives (``spec.cases.materialize``); printed as ``split``."""
        return int(self.seed) % 3 == 2

    @property
    def fused_aux(self) -> bool:
        """With fused kernels and top-K distillation, whether the model's fused kernel also computes the distillation
        terms (``fused_linear_aux``, as VeOmni's ``chunk_topk_distill``): three cases in four (by the seed); the
        fourth is a fused kernel that computes log-probs and entropy only (verl's own), printed ``no_fused_aux``."""
        return int(self.seed) % 4 != 1

    def with_(self, **changes: object) -> "EngineCase":
        """The case with ``changes``; its media follow new rows it was not given media for (an invariant that doubles
        the batch, adds a sample or reorders the rows): sample ``i`` takes sample ``i mod B``'s items where they fit
        its prompt, else none; a change of position kind (images need mRoPE, audio 1-D) or a vocabulary without media
        ids drops them."""
        if self.media and "media" not in changes:
            prompts = changes.get("prompt_lens", self.prompt_lens)
            media = tuple(self.media[i % len(self.media)] if media_fits(self.media[i % len(self.media)], p) else ()
                          for i, p in enumerate(prompts))
            if changes.get("mrope", self.mrope) is self.has_audio or changes.get("vocab", self.vocab) < MIN_MEDIA_VOCAB:
                media = ()
            changes["media"] = media if any(media) else ()
        return replace(self, **changes)

    def subset(self, rows: list[int]) -> "EngineCase":
        """The same case restricted to (and reordered as) ``rows``."""
        temps = self.temperature
        if isinstance(temps, tuple):
            temps = tuple(temps[i] for i in rows)
        media = tuple(self.media[i] for i in rows) if self.media else ()
        return replace(self, prompt_lens=tuple(self.prompt_lens[i] for i in rows),
                       response_lens=tuple(self.response_lens[i] for i in rows), temperature=temps,
                       media=media if any(media) else ())

    def __repr__(self) -> str:
        parts = [f"p={list(self.prompt_lens)}", f"r={list(self.response_lens)}", f"V={self.vocab}",
                 f"T={list(self.temperature) if isinstance(self.temperature, tuple) else self.temperature}",
                 self.mode]
        flags = [name for name, on in (
            ("mrope", self.mrope), ("entropy", self.calculate_entropy),
            ("sum_pi_squared", self.calculate_sum_pi_squared), ("distillation_only", self.distillation_only),
            ("fused", self.use_fused_kernels)) if on]
        parts += flags
        if self.distillation_keys:
            parts.append(f"topk={self.topk}:{','.join(self.distillation_keys)}")
        if self.logits_dtype != "float32":
            parts.append(self.logits_dtype)
        if self.pad_token_id:
            parts.append(f"pad_token_id={self.pad_token_id}")
        if self.eos_token_id is not None:
            parts.append(f"eos={self.eos_token_id}")
        if self.mask_hole_rate != 0.2:
            parts.append(f"holes={self.mask_hole_rate}")
        if self.max_response_len is not None:
            parts.append(f"max_response_len={self.max_response_len}")
        if self.sp_size > 1:
            parts.append(f"sp={self.sp_size}")
        if self.topology is not None:
            parts.append(f"sp_groups={self.topology!r}")
        if self.pad_to_length:
            parts.append(f"bucket={self.pad_to_length}")
        if self.pass_cu_seqlens:
            parts.append("cu_seqlens")
        if self.entropy_chunk_size:
            parts.append(f"chunk={self.entropy_chunk_size}")
        if self.head != "lm":
            parts.append(f"head={self.head}")
        if self.split_view:
            parts.append("split")
        if self.use_fused_kernels and self.distillation_keys and not self.fused_aux:
            parts.append("no_fused_aux")
        if self.context != "grad":
            parts.append(self.context)
        parts += [f"{name}={value}" for name, value in self.engine_config]
        if self.media:
            parts.append("media=[" + ",".join("[" + ",".join(map(repr, items)) + "]" for items in self.media) + "]")
        parts.append(f"seed={self.seed}")
        return "EngineCase(" + " ".join(parts) + ")"


@dataclass(frozen=True)
class DenseCase:
    """A dense left-right padded batch, as a trainer hands it to ``left_right_2_no_padding``."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    prompt_width: int
    response_width: int
    mrope: bool = False
    topk: int = 0  # 0 = no teacher tensors
    mask_holes: bool = False  # zeros inside the response mask (multi-turn tool output)
    seed: int = 0
    vocab: int = 50
    pad_token_id: int = 0
    #: every response ends with the pad id (pad == eos), so a real token equals the pad id
    eos_is_pad: bool = False
    #: MoE router replay: ``routed_experts`` (B, S, layers, top-k) of this many experts (0 = absent)
    routed_experts: int = 0
    #: the router-replay tensor's MoE layers and top-k, and its dtype (verl's agent loop hands int16)
    routed_layers: int = 2
    routed_topk: int = 2
    routed_dtype: str = "int64"

    def __post_init__(self) -> None:
        if not 0 <= self.pad_token_id < self.vocab:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside the vocabulary [0, {self.vocab})")
        if self.routed_experts:
            if self.routed_layers < 1 or not 1 <= self.routed_topk <= self.routed_experts:
                raise ValueError(f"routed_experts (layers={self.routed_layers}, top-k={self.routed_topk}) needs "
                                 f"layers >= 1 and 1 <= top-k <= experts={self.routed_experts}")
            if self.routed_dtype not in ROUTED_DTYPES:
                raise ValueError(f"routed_dtype={self.routed_dtype!r} is not one of {ROUTED_DTYPES}")
            if self.routed_dtype == "uint8" and self.routed_experts > 256:
                raise ValueError(f"routed_dtype uint8 cannot hold expert ids of {self.routed_experts} experts")

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lens)

    def __repr__(self) -> str:
        extra = (" mrope" if self.mrope else "") + (f" topk={self.topk}" if self.topk else "") + (
            " holes" if self.mask_holes else "") + (f" V={self.vocab}" if self.vocab != 50 else "") + (
            f" pad={self.pad_token_id}" if self.pad_token_id else "") + (" eos=pad" if self.eos_is_pad else "") + (
            f" experts={self.routed_experts}({self.routed_layers}x{self.routed_topk}"
            f"{'' if self.routed_dtype == 'int64' else ' ' + self.routed_dtype})" if self.routed_experts else "")
        return (f"DenseCase(p={list(self.prompt_lens)} r={list(self.response_lens)} "
                f"P={self.prompt_width} R={self.response_width}{extra} seed={self.seed})")
