"""Hypothesis strategies for engine cases: structure only, never tensor contents.

Every strategy shrinks towards a batch of one, length-one prompts and responses, the smallest
vocabulary, float32 logits, temperature 1.0, packed mode and every flag off.

Reach (what engines see, drawn cheaply): a size *tier* is drawn first and shrinks to ``small``.

- ``small`` (most cases): B <= 5, prompts and responses <= ``max_len`` tokens, vocab <= 257.
- ``long``: one sequence of 2,049 .. 4,096 tokens (prompt and response up to 2,048 each) among short ones; in one
  long case in four the others are long too (``total_nnz`` up to 16,384); a small vocabulary so logits stay small
  (n x V <= 2**20).
- ``wide``: vocabularies of 257 .. 256,000 ids, real tokenizers' sizes and both sides of 32,768 and 65,536 (ids
  above 255, 32,767 and 65,535 occur), few tokens
  (n x V <= 2**21: the toy model's head is low rank, only the (n, V) logits grow).
- ``batch``: B from 8 to 64 short sequences.

A large tier is drawn with probability ``3/8`` (:data:`TIER_WEIGHTS`: long and batch 3/32 each, wide 6/32), from the
residue of a drawn key (hypothesis's coin flips and small indices are far from their nominal odds), so a 100-example
``ci`` run sees about nine long, nine batch and nineteen wide cases; the ``thorough`` profile (more examples) sees
proportionally more. Logits come in float32, bfloat16 or float16; temperatures are
1.0, log-uniform over [1e-3, 1e2], or at/below the contract's 1e-8 clamp; token ids are uniform over
[0, V) so they include the pad id, and some cases end every response with eos = pad.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ..protocol.profile import POSITIONS, ROUTES_RECORDED, ROUTES_SWITCH, VISION, EngineProfile, takes_mode
from ..truth.audio import AUDIO_STRIDE
from ..truth.vision import MERGE, MIN_MEDIA_VOCAB
from .structure import (CONTEXTS, DISTILLATION_KEYS, LOGITS_DTYPES, LONG_ROW, ROUTED_DTYPES, SMALL_VOCAB,
                        TEMPERATURE_FLOOR, DenseCase, EngineCase, Media)

__all__ = ["seq_lengths", "temperatures", "engine_cases", "dense_cases", "within_limits", "with_pinned_switches", "MODES", "TIERS", "TIER_WEIGHTS",
           "EXPERT_COUNTS", "MOE_LAYERS", "MOE_TOPK", "WIDE_VOCAB_BANDS", "router_replay", "profile_draws",
           "draw_mrope", "media_items", "MEDIA_TIERS", "with_aborted_response", "ABORTED_ONE_IN"]

MODES = ("packed", "padded")
TIERS = ("small", "long", "wide", "batch")
#: the share of cases in each tier (the wide tier's three index-width bands each get about 6% of the cases)
TIER_WEIGHTS = {"small": 20 / 32, "long": 3 / 32, "wide": 6 / 32, "batch": 3 / 32}
_VOCABS = (2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 127, 128, 129, 255, 256, 257)
#: real tokenizers' range, by index-width band (a band first, each equally likely, then a size in it), with the
#: boundaries on both sides of 256, 32,768 and 65,536: ids above 255 only; above 32,767 (int16); above 65,535
#: (uint16). Llama 2 32,000, GPT-2 50,257, Llama 3 128,256, Qwen 151,936 / 152,064, Gemma 256,000.
WIDE_VOCAB_BANDS = {
    "ids <= 32,767": (257, 4_096, 32_000, 32_768),
    "ids <= 65,535": (50_257, 65_536, 32_769),
    "ids > 65,535": (65_537, 100_000, 128_256, 131_072, 151_936, 152_064, 256_000),
}


@st.composite
def router_replay(draw) -> tuple[tuple[int, int, int], str]:
    """A router-replay tensor's ``(experts, MoE layers, top-k)`` and dtype (uint8 only up to 256 experts)."""
    experts = draw(st.sampled_from(EXPERT_COUNTS))
    shape = (experts, draw(st.sampled_from(MOE_LAYERS)), min(draw(st.sampled_from(MOE_TOPK)), experts))
    return shape, draw(st.sampled_from(ROUTED_DTYPES[:3] + (("uint8",) if experts <= 256 else ())))


@st.composite
def _wide_vocab(draw) -> int:
    """A wide-tier vocabulary: an index-width band (equally likely), then a size in it; shrinks to 257."""
    return draw(st.sampled_from(draw(st.sampled_from(tuple(WIDE_VOCAB_BANDS.values())))))
_LONG_VOCABS = (2, 7, 16, 64)
#: MoE router replay as current models have it: experts (Mixtral 8, Qwen1.5-MoE 60, OLMoE/Qwen3 64/128, DeepSeek-V2 160,
#: DeepSeek-V3 256, Kimi K2 384, 512), MoE layers (one, a few), top-k (Switch top-1 .. DeepSeek/Qwen3 top-8)
EXPERT_COUNTS = (8, 1, 2, 60, 64, 128, 160, 256, 257, 384, 512)
MOE_LAYERS = (1, 2, 3, 4)
MOE_TOPK = (1, 2, 4, 6, 8)
#: the largest float below, at and below the contract's 1e-8 temperature clamp
_CLAMPED_TEMPERATURES = (TEMPERATURE_FLOOR, 5e-9, 1e-10)
_LOGITS_BUDGET = {"long": 2 ** 20, "wide": 2 ** 21}


def _check_bounds(**bounds: int) -> None:
    for name, value in bounds.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


#: which tier each residue of the tier key (mod 32) selects: 20 small, 6 wide, 3 long, 3 batch
_TIER_OF_KEY = ("small",) * 20 + ("wide",) * 6 + ("long",) * 3 + ("batch",) * 3


@st.composite
def _tier(draw) -> str:
    """The size tier, from a drawn 16-bit key (mod 32: :data:`TIER_WEIGHTS`); shrinks to small (key 0). A key's
    residue, not coin flips or a weighted ``sampled_from``: hypothesis draws small indices and ``False`` far more
    often than their share (measured on INV-VAL-001 under ``ci``: 1-3 wide cases in 100 examples with coin flips;
    with the key, about 10 wide, 13 batch and 6 long of 106)."""
    return _TIER_OF_KEY[draw(st.integers(0, 2 ** 16 - 1)) % len(_TIER_OF_KEY)]


@st.composite
def _others_long(draw) -> bool:
    """Whether a long case's other sequences are long too (up to 4,096 tokens each, total_nnz up to 16,384): one long
    case in four (a drawn key's residue, as :func:`_tier`; shrinks to short others). The rest have one long sequence
    and short others: the engine's own per-token cost on CPU (verl's log-probs loop over token rows) made long cases
    most of a run's time, and the boundaries a long case is for (2,048 tokens, chunks, buckets) sit in the one long
    sequence, wherever the short ones put it."""
    return draw(st.integers(0, 2 ** 16 - 1)) % 4 == 3


@st.composite
def seq_lengths(draw, batch_size: int, *, max_len: int) -> tuple[int, ...]:
    """``batch_size`` lengths in ``[1, max_len]``, reaching the corners on purpose:
    all equal, the longest first, the longest last, or free. Shrinks to all ones."""
    style = draw(st.sampled_from(("free", "equal", "longest_first", "longest_last")))
    if style == "equal":
        return (draw(st.integers(1, max_len)),) * batch_size
    lens = list(draw(st.lists(st.integers(1, max_len), min_size=batch_size, max_size=batch_size)))
    if style != "free" and batch_size > 1:
        longest = lens.index(max(lens))
        target = 0 if style == "longest_first" else batch_size - 1
        lens[longest], lens[target] = lens[target], lens[longest]
    return tuple(lens)


def one_temperature():
    """One temperature: exactly 1.0 (where it shrinks), log-uniform over [1e-3, 1e2] (low ones often),
    or at/below the 1e-8 clamp."""
    log_uniform = st.integers(-300, 200).map(lambda k: float(f"{10 ** (k / 100):.4g}"))
    return st.one_of(st.just(1.0), log_uniform, st.sampled_from((0.05, 0.01, 0.001)),
                     st.sampled_from(_CLAMPED_TEMPERATURES))


def temperatures(batch_size: int, *, per_sample: bool | None = None):
    """A float (shrinks to 1.0) or ``batch_size`` per-sample values (distinct or not)."""
    scalar = one_temperature()
    vector = st.lists(one_temperature(), min_size=batch_size, max_size=batch_size).map(tuple)
    if per_sample is None:
        return scalar | vector
    return vector if per_sample else scalar


def _budgeted(lens_p: tuple[int, ...], lens_r: tuple[int, ...], vocab: int, budget: int):
    """Shorten sequences (keeping >= 1 token each) until total_nnz * vocab <= budget."""
    cap = max(2, budget // (vocab * len(lens_p)))
    return (tuple(max(1, min(p, cap // 2)) for p in lens_p), tuple(max(1, min(r, cap - cap // 2)) for r in lens_r))


#: what each ``engine_cases`` limit excludes, as a test on a case (the pinned seed examples must honour an
#: engine's ``strategy_limits`` as the drawn cases do)
_LIMIT_EXCLUDES = {
    "allow_sp": lambda c: c.sp_size > 1,
    "allow_bucket": lambda c: bool(c.pad_to_length),
    "allow_fused": lambda c: c.use_fused_kernels,
    "allow_distillation": lambda c: bool(c.distillation_keys),
    "allow_cu_seqlens": lambda c: c.pass_cu_seqlens,
    "allow_chunking": lambda c: bool(c.entropy_chunk_size),
    "allow_sum_pi_squared": lambda c: c.calculate_sum_pi_squared,
}


def profile_draws(profile: EngineProfile) -> dict:
    """The ``engine_cases`` keyword arguments an engine's profile sets: the modes, position kinds, media and
    execution contexts drawn are exactly those it declares."""
    return {"modes": tuple(profile.modes), "positions": tuple(profile.positions), "contexts": tuple(profile.contexts),
            "media": tuple(profile.media), "media_modes": tuple(profile.media_modes),
            "mrope_modes": tuple(profile.mrope_modes)}


#: the size tiers that draw media (their sequences stay short; the wide and long tiers bound n x V)
MEDIA_TIERS = ("small", "batch")
#: the grid sides a media item draws (multiples of the merge size: 1 or 2 merged rows/columns)
_MEDIA_SIDES = (MERGE, 2 * MERGE)


@st.composite
def _media_item(draw, kinds: tuple[str, ...], text_left: int) -> Media:
    """One image (or video, one in four where the engine takes them) of 1-4 merged groups per frame, 1-2 frames,
    after ``0..min(2, text_left)`` text tokens; shrinks to a 2 x 2 image right at the start. ``kinds`` ``("audio",)``:
    an audio clip of 1-3 tokens' frames, one frame past a whole token in one clip in two (a leftover frame the encoder
    drops), shrinking to one token's."""
    if kinds == ("audio",):
        return Media("audio", frames=draw(st.integers(AUDIO_STRIDE, 3 * AUDIO_STRIDE + 1)),
                     gap=draw(st.integers(0, min(2, text_left))))
    kind = "video" if "video" in kinds and draw(st.integers(0, 3)) == 3 or "image" not in kinds else "image"
    return Media(kind, t=draw(st.sampled_from((1, 2))) if kind == "video" else 1,
                 h=draw(st.sampled_from(_MEDIA_SIDES)), w=draw(st.sampled_from(_MEDIA_SIDES)),
                 gap=draw(st.integers(0, min(2, text_left))))


@st.composite
def media_items(draw, prompt_lens: tuple[int, ...], kinds: tuple[str, ...]) -> tuple[tuple[Media, ...], ...]:
    """Per sample 0-2 media items in its prompt's text (a text-only sample among image samples included); at
    least one in the batch (sample 0's, where none was drawn)."""
    media = []
    for p in prompt_lens:
        items: list[Media] = []
        left = p
        for _ in range(draw(st.integers(0, 2))):
            items.append(draw(_media_item(kinds, left)))
            left -= items[-1].gap
        media.append(tuple(items))
    if not any(media):
        media[0] = (draw(_media_item(kinds, prompt_lens[0])),)
    return tuple(media)


def _with_media(draw, case: EngineCase, kinds: tuple[str, ...], tier: str, media_modes: tuple[str, ...] = MODES,
                pinned: bool = True) -> EngineCase:
    """``case`` with media in two cases in three of those that can carry them (audio clips: one in three) (a
    vocabulary with media ids, a short tier, a mode the engine takes media in: ``media_modes``, both of them where the
    target left the mode to the draw (``pinned`` False: it may compare the two); a drawn key's residue, shrinking to
    none), the prompts lengthened by their tokens: images and videos where the case has mRoPE positions, audio clips
    where it has 1-D ones (each kind the engine takes: ``kinds``)."""
    in_mode = takes_mode(case.mode if pinned else "both", media=True, media_modes=media_modes)
    kinds = tuple(k for k in kinds if k in VISION) if case.mrope else tuple(k for k in kinds if k == "audio")
    if not kinds or not in_mode or case.vocab < MIN_MEDIA_VOCAB or tier not in MEDIA_TIERS:
        return case
    residue = draw(st.integers(0, 2 ** 16 - 1)) % 3
    if residue == 0 or kinds == ("audio",) and residue == 1:  # audio in one 1-D case in three: text stays the most
        return case
    media = draw(media_items(case.prompt_lens, kinds))
    prompts = tuple(p + sum(m.tokens for m in items) for p, items in zip(case.prompt_lens, media))
    return case.with_(prompt_lens=prompts, media=media)


def draw_mrope(draw, positions: tuple[str, ...] = POSITIONS) -> bool:
    """Whether a case hands mRoPE ``(4, ...)`` positions: drawn where both kinds are accepted (shrinking to 2-D),
    else the one kind ``positions`` names (no draw)."""
    if "mrope" in positions and "rope" in positions:
        return draw(st.booleans())
    return "mrope" in positions


def within_limits(case: EngineCase, **limits) -> bool:
    """Whether ``engine_cases(**limits)`` could draw ``case`` as far as the engine-facing limits go (features,
    per-sample temperature, logits dtypes, the profile's modes, positions, media and contexts); size bounds are not
    checked."""
    for key, excludes in _LIMIT_EXCLUDES.items():
        if limits.get(key, True) is False and excludes(case):
            return False
    if not takes_mode(case.mode, mrope=case.mrope, media=bool(case.media), modes=limits.get("modes", MODES),
                      mrope_modes=limits.get("mrope_modes", MODES), media_modes=limits.get("media_modes", MODES)) or \
            ("mrope" if case.mrope else "rope") not in limits.get("positions", POSITIONS):
        return False
    if not {item.kind for items in case.media for item in items} <= set(limits.get("media", ())):
        return False
    per_sample = limits.get("per_sample_temperature")
    if per_sample is not None and not case.use_fused_kernels and case.per_sample_temperature != per_sample:
        return False
    return case.logits_dtype in limits.get("logits_dtypes", LOGITS_DTYPES) and \
        case.context in limits.get("contexts", CONTEXTS)


@st.composite
def engine_cases(draw, *, mode: str | None = None, max_batch: int = 5, max_len: int = 8,
                 head: str = "lm", allow_sp: bool = True, allow_bucket: bool = True,
                 allow_fused: bool = True, allow_distillation: bool = True, allow_cu_seqlens: bool = True,
                 allow_chunking: bool = True, allow_sum_pi_squared: bool = True, allow_large: bool = True,
                 padding: bool = False,
                 per_sample_temperature: bool | None = None, tier: str | None = None,
                 logits_dtypes: tuple[str, ...] = LOGITS_DTYPES,
                 contexts: tuple[str, ...] = CONTEXTS, config_space: tuple = (),
                 modes: tuple[str, ...] = MODES, positions: tuple[str, ...] = POSITIONS,
                 media: tuple[str, ...] = (), media_modes: tuple[str, ...] = MODES,
                 mrope_modes: tuple[str, ...] = MODES, pin_tail_rule: bool = False,
                 pin_routes: bool | str = False) -> EngineCase:
    """An :class:`EngineCase` with every flag combination the contract allows.

    ``mode`` pins packed/padded (``None`` draws one of ``modes``). ``modes``, ``positions`` (``rope``: 2-D,
    ``mrope``: ``(4, ...)``) and ``contexts`` are what the engine's profile accepts (:func:`profile_draws`): a
    single one is not drawn at all, so an engine never sees what it does not take. Sequence parallelism and the
    static bucket only apply to the packed mode; the bucket is never combined with
    top-K distillation (the contract makes that an error), fused kernels need one
    float temperature, and sequence parallelism is not drawn with distillation (the
    suite's processor aligns teacher tensors with the whole packed row).

    ``logits_dtypes`` restricts the logits' dtypes (an engine's ``strategy_limits`` may, to keep a
    documented low-precision limitation from drowning its other results). ``tier`` pins the size tier.
    ``contexts``: the autograd contexts drawn (:data:`~spec.cases.structure.CONTEXTS`, shrinking to ``grad``;
    drawn last, so the other draws of a derandomized run stay where they were). ``config_space``: the engine's own
    switches (``spec.protocol.ConfigSwitch``) drawn after it, each from its values (shrinking to the first, its
    default, which the case leaves out); a switch drawn as one of the suite's settings draws nothing here.
    ``pin_tail_rule``: a switch that sets the packed row's tail multiple (``ConfigSwitch.tail_multiple``) is drawn
    from its values off the default only (INV-PAD-003, which checks that rule, runs where it applies);
    ``pin_routes`` likewise the switch collating routed experts (``spec.protocol.profile.ROUTES_SWITCH``,
    INV-ROUTE-001): drawn to a dtype of the rollout's routes; ``pin_routes="record"`` to its value having the engine
    record the routes instead (``ROUTES_RECORDED``, INV-ROUTE-002).
    ``media``: the media kinds the engine hands its model (its profile's); drawn last, in two cases in three of the
    small and batch tiers' mRoPE cases (images and videos) and, where it takes audio, of their 1-D cases (audio
    clips) (:func:`media_items`), so every earlier draw stays where it was; only in
    ``media_modes`` (the profile's: a target that leaves the mode to the draw gets media only if both are listed);
    mRoPE positions likewise only in ``mrope_modes``.
    ``padding=True`` forces padding to exist: unequal lengths (padded mode) and a packed tail
    (a static bucket, else sequence parallelism, as the engine allows; then no distillation).
    """
    _check_bounds(max_batch=max_batch, max_len=max_len)
    if mode not in (None, *MODES):
        raise ValueError(f"mode must be None or one of {MODES}, got {mode!r}")
    if not modes or not set(modes) <= set(MODES) or not positions or not set(positions) <= set(POSITIONS):
        raise ValueError(f"modes {modes!r} / positions {positions!r}: non-empty subsets of {MODES} / {POSITIONS}")
    if mode is None and len(modes) == 1:
        mode = modes[0]
    tier = tier or (draw(_tier()) if allow_large else "small")
    if tier == "batch":
        batch = draw(st.integers(8, 64))
    else:
        batch = draw(st.integers(1, 4 if tier == "long" else 3 if tier == "wide" else max_batch))
    length = {"long": LONG_ROW, "wide": 8}.get(tier, max_len)
    if tier == "long" and not draw(_others_long()):
        length = max_len
    prompts = draw(seq_lengths(batch, max_len=length))
    responses = draw(seq_lengths(batch, max_len=length))
    if tier == "long":  # one sequence of 2,049 .. 4,096 tokens (integer draws favour small values)
        at = draw(st.integers(0, batch - 1))
        prompts = prompts[:at] + (draw(st.integers(LONG_ROW // 2 + 1, LONG_ROW)),) + prompts[at + 1:]
        responses = responses[:at] + (draw(st.integers(LONG_ROW // 2, LONG_ROW)),) + responses[at + 1:]
    if tier == "wide":
        vocab = draw(_wide_vocab())
    elif tier == "long":
        vocab = draw(st.sampled_from(_LONG_VOCABS))
    else:
        vocab = draw(st.sampled_from(_VOCABS))
    if tier in _LOGITS_BUDGET:
        prompts, responses = _budgeted(prompts, responses, vocab if head == "lm" else 1, _LOGITS_BUDGET[tier])
    packed = (not draw(st.booleans())) if mode is None else mode == "packed"
    # fused kernels in about a quarter of the cases
    fused = head == "lm" and allow_fused and draw(st.booleans()) and draw(st.booleans())
    temperature = draw(temperatures(batch, per_sample=False if fused else per_sample_temperature))
    distill: tuple[str, ...] = ()
    if head == "lm" and allow_distillation and not fused and draw(st.booleans()):
        distill = tuple(draw(st.lists(st.sampled_from(DISTILLATION_KEYS), min_size=1, max_size=3, unique=True)))
    sp = 1
    bucket = None
    if packed and allow_sp and not distill:
        sp = draw(st.sampled_from((1, 2, 3, 4)))
    if packed and allow_bucket and not distill and draw(st.booleans()):
        bucket = draw(st.sampled_from((4, 7, 8, 16) if tier != "long" else (4, 7, 1024, 4096)))
    if padding:
        if batch == 1 or len({p + r for p, r in zip(prompts, responses)}) == 1:
            prompts = prompts[:-1] + (prompts[-1] + 1,) if batch > 1 else prompts
            if batch == 1:
                batch, prompts, responses = 2, prompts + (prompts[0] + 1,), responses * 2
                if isinstance(temperature, tuple):
                    temperature = temperature * 2
        total = sum(prompts) + sum(responses)
        if packed and (allow_bucket or allow_sp):
            distill = ()
            if allow_bucket:
                bucket = bucket or 8
                bucket = bucket if total % bucket else bucket + 1
            elif total % sp == 0:
                sp = next(k for k in (2, 3, 4, 5, 7) if total % k)
    width = None
    if draw(st.booleans()):
        width = max(responses) + draw(st.integers(0, 3))
    chunks = (None, None, 1, 2, 3, 7) if tier != "long" else (None, None, 1000, 2047, 4096)
    pad_choice = draw(st.sampled_from(("zero", "one", "last")))
    pad_id = {"zero": 0, "one": min(1, vocab - 1), "last": vocab - 1}[pad_choice]
    eos_choice = draw(st.sampled_from(("none", "pad", "other")))
    eos = {"none": None, "pad": pad_id, "other": (pad_id + 1) % vocab}[eos_choice]
    case = EngineCase(
        prompt_lens=prompts, response_lens=responses,
        vocab=vocab,
        temperature=temperature,
        mrope=draw_mrope(draw, positions) and takes_mode(("packed" if packed else "padded") if mode is not None
                                                         else "both", mrope=True, mrope_modes=mrope_modes),
        use_remove_padding=packed,
        calculate_entropy=head == "lm" and draw(st.booleans()),
        calculate_sum_pi_squared=head == "lm" and not fused and allow_sum_pi_squared and draw(st.booleans()),
        distillation_keys=distill,
        distillation_only=bool(distill) and draw(st.booleans()),
        use_fused_kernels=fused,
        topk=draw(st.integers(1, min(4, vocab))),  # a teacher's top-K: at most V ids
        pad_token_id=pad_id,
        max_response_len=width,
        sp_size=sp,
        pad_to_length=bucket,
        pass_cu_seqlens=packed and allow_cu_seqlens and draw(st.booleans()),
        entropy_chunk_size=draw(st.sampled_from(chunks)) if allow_chunking else None,
        head=head,
        logits_dtype=draw(st.sampled_from(logits_dtypes)),
        eos_token_id=eos if head == "lm" else None,
        mask_hole_rate=draw(st.sampled_from((0.2, 0.0, 0.5))),
        seed=draw(st.integers(0, 2**16)),
        context=draw(st.sampled_from(contexts)),
        engine_config=_engine_config(draw, config_space, head, pin_tail_rule, pin_routes),
    )
    return _with_media(draw, case, media, tier, media_modes, pinned=mode is not None)


def _pinned(switch, tail_rule: bool, routes: bool | str) -> tuple | None:
    """The values ``switch`` is drawn from where it is drawn off its default only, else None: the one setting the tail
    multiple (``tail_rule``), the one collating routed experts (``routes``: to a dtype of the rollout's routes;
    ``"record"``: to :data:`ROUTES_RECORDED`, the R2 record, where the switch has it)."""
    if tail_rule and switch.tail_multiple:
        return switch.values[1:]
    if routes and switch.name == ROUTES_SWITCH:
        record = routes == ROUTES_RECORDED
        return tuple(v for v in switch.values[1:] if (v == ROUTES_RECORDED) == record) or None
    return None


def _engine_config(draw, space: tuple, head: str, pin_tail_rule: bool = False,
                   pin_routes: bool | str = False) -> tuple[tuple[str, object], ...]:
    """The drawn values of the switches of ``space`` that differ from their defaults (the first value); a switch
    needing the value head is drawn for value-head cases only; with ``pin_tail_rule`` (``pin_routes``), a switch
    setting the tail multiple (collating routed experts) is drawn off its default."""
    drawn = []
    for switch in space:
        if switch.setting is not None or len(switch.values) < 2:
            continue
        if "value" in switch.needs and head != "value":
            continue
        pinned = _pinned(switch, pin_tail_rule, pin_routes)
        value = draw(st.sampled_from(pinned or switch.values))
        if value != switch.values[0]:
            drawn.append((switch.name, value))
    return tuple(drawn)


def with_pinned_switches(case: EngineCase, space: tuple, *, tail_rule: bool = False,
                         routes: bool | str = False) -> EngineCase:
    """``case`` with each switch of ``space`` that ``engine_cases`` draws off its default only (:func:`_pinned`: with
    ``tail_rule`` the one setting the tail multiple, ``ConfigSwitch.tail_multiple``; with ``routes`` the one
    collating routed experts) at its first value off the default, as ``engine_cases(pin_tail_rule=True)``
    (``pin_routes``) draws it (the pinned seed cases of INV-PAD-003, INV-ROUTE-001)."""
    pinned = {switch.name: values[0] for switch in space if (values := _pinned(switch, tail_rule, routes))}
    if not pinned:
        return case
    kept = tuple((name, value) for name, value in case.engine_config if name not in pinned)
    return case.with_(engine_config=kept + tuple(pinned.items()))


@st.composite
def dense_cases(draw, *, max_batch: int = 5, max_len: int = 8, allow_large: bool = True,
                topk: bool | None = None, routed_experts: bool | None = None,
                positions: tuple[str, ...] = POSITIONS) -> DenseCase:
    """A left-padded-prompt, right-padded-response dense batch (with slack columns).

    Token ids are uniform over [0, V) (so real tokens equal the pad id), some cases end every
    response with eos = pad, vocabularies reach 256,000 ids and batches 64 rows; router-replay tensors of 1-512 experts,
    1-4 MoE layers, top-1 to top-8, in int64/int32/int16/uint8; one batch in six an aborted rollout's empty response
    (drawn last: :func:`with_aborted_response`)."""
    _check_bounds(max_batch=max_batch, max_len=max_len)
    tier = draw(_tier()) if allow_large else "small"
    batch = draw(st.integers(8, 64)) if tier == "batch" else draw(st.integers(1, max_batch))
    length = 256 if tier == "long" else max_len
    prompts = draw(seq_lengths(batch, max_len=length))
    responses = draw(seq_lengths(batch, max_len=length))
    vocab = draw(_wide_vocab()) if tier == "wide" else draw(st.sampled_from((2, 7, 50, 129, 257)))
    pad_choice = draw(st.sampled_from(("zero", "one", "last")))
    with_topk = draw(st.booleans()) if topk is None else topk
    with_experts = draw(st.booleans()) if routed_experts is None else routed_experts
    (experts, layers, top_k), routed_dtype = draw(router_replay()) if with_experts else ((0, 2, 2), "int64")
    case = DenseCase(
        prompt_lens=prompts, response_lens=responses,
        prompt_width=max(prompts) + draw(st.integers(0, 2)),
        response_width=max(responses) + draw(st.integers(0, 2)),
        mrope=draw_mrope(draw, positions),
        topk=draw(st.sampled_from((1, 3))) if with_topk else 0,
        mask_holes=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
        vocab=vocab,
        pad_token_id={"zero": 0, "one": 1, "last": vocab - 1}[pad_choice],
        eos_is_pad=draw(st.booleans()),
        routed_experts=experts, routed_layers=layers, routed_topk=top_k, routed_dtype=routed_dtype,
    )
    return with_aborted_response(case, draw(st.integers(0, ABORTED_ONE_IN - 1)))


#: one drawn batch in this many (of two samples or more) holds an aborted rollout: a zero-length response
ABORTED_ONE_IN = 6


def with_aborted_response(case, key: int):
    """``case`` (a dense or a mini-batch case) with the response of sample ``seed mod B`` empty (an aborted rollout,
    docs/contract.md "Degenerate lengths") when the drawn ``key`` is the last of :data:`ABORTED_ONE_IN` (shrinking to
    none) and there are two samples or more; its widths stay."""
    if key != ABORTED_ONE_IN - 1 or case.batch_size < 2:
        return case
    i = int(case.seed) % case.batch_size
    return replace(case, response_lens=case.response_lens[:i] + (0,) + case.response_lens[i + 1:])
