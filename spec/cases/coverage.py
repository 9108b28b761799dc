"""Coverage of the input space: the dimensions a drawn case has, and the values each dimension can take.

:func:`dimensions` names, for one case, the value it has on every drawn dimension (a case with several
temperatures has several temperature ranges). The runner counts them per example (``Outcome.coverage``); the
report shows, per engine, the share of examples that had each value, and each value never seen with its reason
(:func:`domains`: a feature the engine lacks, or a configuration value it declares but the suite does not draw).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..protocol.engine import Feature
from ..protocol.profile import MODES, drawn_config, profile_of
from .microbatch import MiniBatchCase
from .structure import (CONTEXTS, EXECUTION_CONTEXTS, LOGITS_DTYPES, LONG_ROW, ROUTED_DTYPES, SMALL_VOCAB,
                        TEMPERATURE_FLOOR, DenseCase, EngineCase)

__all__ = ["dimensions", "domains", "DIMENSIONS", "MB_DIMENSIONS", "FEATURES", "EXCLUDED_PAIRS", "PAIRS", "VOCAB_BANDS", "temperature_range", "tier_of", "vocab_band"]

TEMPERATURE_RANGES = ("1", "at/below the 1e-8 clamp", "(1e-8, 0.1)", "[0.1, 1)", "(1, 100]")
#: the index width a vocabulary's ids need (spec.cases.strategies.WIDE_VOCAB_BANDS, the small tier's below)
VOCAB_BANDS = ("V <= 257", "ids <= 32,767", "ids <= 65,535", "ids > 65,535")

#: dimension -> its values, and for a value that needs an engine feature, the feature
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "logits dtype": LOGITS_DTYPES,
    "temperature": TEMPERATURE_RANGES,
    "per-sample temperature": ("no", "yes"),
    "size tier": ("small", "long", "wide", "batch"),
    "vocab band": VOCAB_BANDS,
    "batch size": ("1", "2-7", "8-64"),
    "lengths": ("all equal", "unequal"),
    "pad id": ("0", "1", "V-1"),
    "eos": ("none", "= pad id (a real token equals the pad id)", "other"),
    "loss-mask holes": ("0.0", "0.2", "0.5"),
    "layout": ("packed", "padded"),
    "positions": ("2-D", "mRoPE"),
    "split view": ("no", "yes"),
    "execution context": EXECUTION_CONTEXTS,
    "sp size": ("1", "2", "3", "4"),
    "sp groups": ("no sp", "single", "shifted", "contiguous", "interleaved"),
    "static bucket": ("no", "yes"),
    "cu_seqlens passed": ("no", "yes"),
    "chunk size set": ("no", "yes"),
    "fused kernels": ("no", "yes"),
    "entropy": ("no", "yes"),
    "sum_pi_squared": ("no", "yes"),
    "distillation": ("no", "yes"),
    "head": ("lm", "value"),
    "media": ("none", "image", "video", "image and video"),
    "media per sample": ("no media", "every sample", "some samples text-only"),
}

#: the drawn dimensions of a micro-batch case (spec.cases.microbatch), each value needing the micro-batch layer
MB_DIMENSIONS: dict[str, tuple[str, ...]] = {
    "micro-batch: execution context": CONTEXTS,
    "micro-batch: path": ("token budget", "fixed size"),
    "micro-batch: batch size": ("1", "2-8", "9-64", "> 64"),
    "micro-batch: forced groups": ("no", "yes"),
    "micro-batch: sp size": ("1", "2", "4"),
    "micro-batch: routed experts": ("none", *ROUTED_DTYPES),
    "micro-batch: mRoPE": ("no", "yes"),
    "micro-batch: media": ("no", "yes"),
    "micro-batch: data-parallel ranks": ("1", "2+"),
}

#: the features whose pairs are covered (issue 27: a PPO critic under Ulysses SP is an ordinary configuration):
#: name -> (whether a case has it, the engine feature it needs or None)
FEATURES: dict[str, tuple[Callable[[EngineCase], bool], Feature | None]] = {
    "packed": (lambda c: c.use_remove_padding, None),
    "padded": (lambda c: not c.use_remove_padding, None),
    "value head": (lambda c: c.head == "value", Feature.VALUE),
    "sp": (lambda c: c.sp_size > 1, Feature.SP),
    "static bucket": (lambda c: bool(c.pad_to_length), Feature.BUCKET),
    "cu_seqlens": (lambda c: c.pass_cu_seqlens, Feature.CU_SEQLENS),
    "chunked entropy": (lambda c: bool(c.entropy_chunk_size), Feature.CHUNKING),
    "fused kernels": (lambda c: c.use_fused_kernels, Feature.FUSED),
    "distillation": (lambda c: bool(c.distillation_keys), Feature.DISTILLATION),
    "entropy": (lambda c: c.calculate_entropy, None),
    "sum_pi_squared": (lambda c: c.calculate_sum_pi_squared, Feature.SUM_PI_SQUARED),
    "mRoPE": (lambda c: c.mrope, None),
    "per-sample temperature": (lambda c: c.per_sample_temperature, Feature.PER_SAMPLE_TEMPERATURE),
    "split view": (lambda c: c.split_view, None),
    "no grad": (lambda c: c.context != "grad", None),
    "bf16/fp16 logits": (lambda c: c.logits_dtype != "float32", None),
    "eos = pad": (lambda c: c.eos_token_id is not None and c.eos_token_id == c.pad_token_id, None),
    "wide vocab": (lambda c: c.vocab > SMALL_VOCAB, None),
    "long rows": (lambda c: max(c.seq_lens) > LONG_ROW, None),
    "batch >= 8": (lambda c: c.batch_size >= 8, None),
}

_VALUE_ONLY_LM = "the value head returns values only (no entropy, sum_pi_squared, distillation or fused log-probs)"
_PACKED_ONLY = "a packed-only feature (the padded mode has no such setting)"
_TIERS = "the size tiers are drawn one at a time (a case stays cheap)"
#: feature pairs the contract (or the suite, where it says so) never combines, with why
EXCLUDED_PAIRS: dict[frozenset[str], str] = {
    frozenset(("packed", "padded")): "one mode per case",
    **{frozenset(("padded", f)): _PACKED_ONLY for f in ("sp", "static bucket", "cu_seqlens")},
    **{frozenset(("value head", f)): _VALUE_ONLY_LM for f in ("entropy", "sum_pi_squared", "distillation",
                                                               "fused kernels")},
    frozenset(("value head", "eos = pad")): "a value model's batch carries no eos id",
    frozenset(("fused kernels", "sum_pi_squared")): "fused kernels return log-probs and entropy only",
    **{frozenset(pair): _TIERS for pair in (("wide vocab", "long rows"), ("wide vocab", "batch >= 8"),
                                              ("long rows", "batch >= 8"))},
}
PAIRS = tuple(f"{a} x {b}" for i, a in enumerate(FEATURES) for b in tuple(FEATURES)[i + 1:]
              if frozenset((a, b)) not in EXCLUDED_PAIRS)

#: (dimension, value) -> the feature an engine must offer to see it
_NEEDS = {("sp size", v): Feature.SP for v in ("2", "3", "4")} | {
    ("sp groups", v): Feature.SP for v in ("single", "shifted", "contiguous", "interleaved")} | {
    ("static bucket", "yes"): Feature.BUCKET, ("cu_seqlens passed", "yes"): Feature.CU_SEQLENS,
    ("chunk size set", "yes"): Feature.CHUNKING, ("fused kernels", "yes"): Feature.FUSED,
    ("sum_pi_squared", "yes"): Feature.SUM_PI_SQUARED, ("distillation", "yes"): Feature.DISTILLATION,
    ("head", "value"): Feature.VALUE, ("per-sample temperature", "yes"): Feature.PER_SAMPLE_TEMPERATURE,
}


def temperature_range(t: float) -> str:
    if t == 1.0:
        return "1"
    if t <= TEMPERATURE_FLOOR:
        return "at/below the 1e-8 clamp"
    if t < 0.1:
        return "(1e-8, 0.1)"
    return "[0.1, 1)" if t < 1.0 else "(1, 100]"


def tier_of(case: EngineCase) -> str:
    """The size tier a case is in (``spec.cases.strategies``), read off its sizes."""
    if case.vocab > SMALL_VOCAB:  # the small and long tiers' vocabularies are at most SMALL_VOCAB
        return "wide"
    if max(case.seq_lens) > LONG_ROW:
        return "long"
    return "batch" if case.batch_size >= 8 else "small"


def vocab_band(vocab: int) -> str:
    if vocab <= SMALL_VOCAB:
        return VOCAB_BANDS[0]
    return VOCAB_BANDS[1] if vocab <= 32_768 else VOCAB_BANDS[2] if vocab <= 65_536 else VOCAB_BANDS[3]


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def dimensions(case: Any, config_space: Iterable[Any] = ()) -> list[tuple[str, str]]:
    """``(dimension, value)`` for every drawn dimension of ``case`` (an ``EngineCase``; a ``DenseCase`` has its
    own few), plus ``engine config: <name>`` for each switch of ``config_space`` drawn as its own value."""
    if isinstance(case, DenseCase):
        return [("dense: mRoPE", _yes(case.mrope)), ("dense: holes", _yes(case.mask_holes)),
                ("dense: eos = pad", _yes(case.eos_is_pad)), ("dense: teacher top-K", _yes(case.topk)),
                ("dense: routed experts", case.routed_dtype if case.routed_experts else "none"),
                ("dense: vocab band", vocab_band(case.vocab))]
    if isinstance(case, MiniBatchCase):
        b = case.batch_size
        return [("micro-batch: execution context", case.context),
                ("micro-batch: path", "token budget" if case.use_dynamic_bsz else "fixed size"),
                ("micro-batch: batch size", "1" if b == 1 else "2-8" if b <= 8 else "9-64" if b <= 64 else "> 64"),
                ("micro-batch: forced groups", _yes(case.force_group_size > 1)),
                ("micro-batch: sp size", str(case.sp_size)),
                ("micro-batch: routed experts", case.routed_dtype if case.routed_experts else "none"),
                ("micro-batch: mRoPE", _yes(case.mrope)), ("micro-batch: media", _yes(case.media)),
                ("micro-batch: data-parallel ranks", "1" if case.world == 1 else "2+")]
    if not isinstance(case, EngineCase):
        return []
    b = case.batch_size
    out = [("logits dtype", case.logits_dtype), ("per-sample temperature", _yes(case.per_sample_temperature)),
           ("size tier", tier_of(case)), ("vocab band", vocab_band(case.vocab)), ("batch size", "1" if b == 1 else "2-7" if b < 8 else "8-64"),
           ("lengths", "all equal" if len(set(case.seq_lens)) == 1 else "unequal"),
           ("pad id", "0" if case.pad_token_id == 0 else "V-1" if case.pad_token_id == case.vocab - 1 else "1"),
           ("eos", "none" if case.eos_token_id is None else "= pad id (a real token equals the pad id)"
            if case.eos_token_id == case.pad_token_id else "other"),
           ("loss-mask holes", str(case.mask_hole_rate)), ("layout", case.mode),
           ("positions", "mRoPE" if case.mrope else "2-D"), ("split view", _yes(case.split_view)),
           ("execution context", case.context), ("sp size", str(case.sp_size)),
           ("sp groups", case.topology.layout if case.topology is not None
            else "single" if case.sp_size > 1 else "no sp"),
           ("static bucket", _yes(case.pad_to_length)), ("cu_seqlens passed", _yes(case.pass_cu_seqlens)),
           ("chunk size set", _yes(case.entropy_chunk_size)), ("fused kernels", _yes(case.use_fused_kernels)),
           ("entropy", _yes(case.calculate_entropy)), ("sum_pi_squared", _yes(case.calculate_sum_pi_squared)),
           ("distillation", _yes(case.distillation_keys)), ("head", case.head)]
    kinds = {item.kind for items in case.media for item in items}
    out += [("media", " and ".join(sorted(kinds)) or "none"),
            ("media per sample", "no media" if not kinds else "every sample" if all(case.media)
             else "some samples text-only")]
    out += sorted({("temperature", temperature_range(t)) for t in case.temperatures()})
    has = [name for name, (present, _) in FEATURES.items() if present(case)]
    out += [("feature pair", f"{a} x {b}") for i, a in enumerate(has) for b in has[i + 1:]
            if frozenset((a, b)) not in EXCLUDED_PAIRS]
    drawn = drawn_config(case)
    for switch in config_space:
        if switch.setting is None and switch.values:
            out.append((f"engine config: {switch.name}", repr(drawn.get(switch.name, switch.values[0]))))
    return out


def domains(engine: Any) -> dict[str, dict[str, str | None]]:
    """dimension -> value -> why ``engine`` is not expected to see it (None: expected). A lacking feature gives
    the engine's reason; a configuration value it declares as not drawn gives the declared reason."""
    lacks = getattr(engine, "lacks", lambda feature: None)
    profile = profile_of(engine)
    # what the engine's profile says it is: the modes, position kinds and execution contexts drawn for it
    is_not = {("layout", m): profile.mode_reason(m) for m in ("packed", "padded")} | {
        ("positions", "2-D"): profile.position_reason("rope"), ("positions", "mRoPE"): profile.position_reason("mrope"),
    } | {("execution context", c): profile.context_reason(c) for c in EXECUTION_CONTEXTS} | {
        ("media", v): next(filter(None, map(profile.media_reason, v.split(" and "))), None)
        for v in DIMENSIONS["media"][1:]} | {
        ("media per sample", v): profile.media_reason("image") and profile.media_reason("video")
        for v in DIMENSIONS["media per sample"][1:]}
    feature_is_not = {"packed": is_not[("layout", "packed")], "padded": is_not[("layout", "padded")],
                      "mRoPE": is_not[("positions", "mRoPE")],
                      "no grad": None if set(profile.contexts) - {"grad"} else profile.context_reason("no_grad")}
    out: dict[str, dict[str, str | None]] = {}
    for dim, values in DIMENSIONS.items():
        out[dim] = {v: is_not.get((dim, v)) or (lacks(_NEEDS[(dim, v)]) if (dim, v) in _NEEDS else None)
                    for v in values}

    def pair_reason(pair: str) -> str | None:
        features = pair.split(" x ")
        mode = next((m for m in MODES if m in features), None)
        if "mRoPE" in features and mode is not None and profile.runs(mode) and not profile.takes(mode, mrope=True):
            return (f"the engine takes mRoPE positions in the {' and '.join(profile.mrope_modes)} mode only (its "
                    f"profile: mrope_modes={profile.mrope_modes!r})")
        return next((feature_is_not.get(f) or lacks(FEATURES[f][1]) for f in features
                     if feature_is_not.get(f) or (FEATURES[f][1] is not None and lacks(FEATURES[f][1]))), None)

    out["feature pair"] = {pair: pair_reason(pair) for pair in PAIRS}
    no_layer = lacks(Feature.MICROBATCH)
    for dim, values in MB_DIMENSIONS.items():
        out[dim] = {v: no_layer for v in values}
    out["micro-batch: data-parallel ranks"]["2+"] = no_layer or lacks(Feature.REAL_RANKS)
    out["micro-batch: media"]["yes"] = no_layer or lacks(Feature.MEDIA)
    for switch in getattr(engine, "config_space", tuple)():
        if switch.setting is not None:
            continue
        missing = next((lacks(need) for need in switch.needs if lacks(need)), None)
        values = {repr(v): missing for v in switch.values}
        values.update({repr(v): reason for v, reason in switch.unseen.items()})
        out[f"engine config: {switch.name}"] = values
    return out
