"""Hypothesis strategies for engine cases: structure only, never tensor contents.

Every strategy shrinks towards a batch of one, length-one prompts and responses,
the smallest vocabulary, temperature 1.0, packed mode and every flag off.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import DISTILLATION_KEYS, DenseCase, EngineCase

__all__ = ["seq_lengths", "temperatures", "engine_cases", "dense_cases", "MODES"]

MODES = ("packed", "padded")
_VOCABS = (2, 3, 7, 8, 9, 16, 31, 32, 33, 64, 127, 128, 129)
# Down to 0.1: below that float32 rounding of logits / T alone exceeds the suite's tolerance.
_TEMPERATURE_VALUES = (1.0, 0.5, 2.0, 0.7, 1.3, 0.1, 5.0)


def _check_bounds(**bounds: int) -> None:
    for name, value in bounds.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


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


def temperatures(batch_size: int, *, per_sample: bool | None = None):
    """A float (shrinks to 1.0) or ``batch_size`` distinct-ish per-sample values."""
    scalar = st.sampled_from(_TEMPERATURE_VALUES)
    vector = st.lists(st.sampled_from(_TEMPERATURE_VALUES), min_size=batch_size, max_size=batch_size).map(tuple)
    if per_sample is None:
        return scalar | vector
    return vector if per_sample else scalar


@st.composite
def engine_cases(draw, *, mode: str | None = None, max_batch: int = 5, max_len: int = 8,
                 head: str = "lm", allow_sp: bool = True, allow_bucket: bool = True,
                 allow_fused: bool = True, allow_distillation: bool = True, allow_cu_seqlens: bool = True,
                 allow_chunking: bool = True,
                 per_sample_temperature: bool | None = None) -> EngineCase:
    """An :class:`EngineCase` with every flag combination the contract allows.

    ``mode`` pins packed/padded (``None`` draws it). Sequence parallelism and the
    static bucket only apply to the packed mode; the bucket is never combined with
    top-K distillation (the contract makes that an error), fused kernels need one
    float temperature, and sequence parallelism is not drawn with distillation (the
    suite's processor aligns teacher tensors with the whole packed row).
    """
    _check_bounds(max_batch=max_batch, max_len=max_len)
    if mode not in (None, *MODES):
        raise ValueError(f"mode must be None or one of {MODES}, got {mode!r}")
    batch = draw(st.integers(1, max_batch))
    prompts = draw(seq_lengths(batch, max_len=max_len))
    responses = draw(seq_lengths(batch, max_len=max_len))
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
        bucket = draw(st.sampled_from((4, 7, 8, 16)))
    width = None
    if draw(st.booleans()):
        width = max(responses) + draw(st.integers(0, 3))
    return EngineCase(
        prompt_lens=prompts, response_lens=responses,
        vocab=draw(st.sampled_from(_VOCABS)),
        temperature=temperature,
        mrope=draw(st.booleans()),
        use_remove_padding=packed,
        calculate_entropy=head == "lm" and draw(st.booleans()),
        calculate_sum_pi_squared=head == "lm" and not fused and draw(st.booleans()),
        distillation_keys=distill,
        distillation_only=bool(distill) and draw(st.booleans()),
        use_fused_kernels=fused,
        topk=draw(st.integers(1, 4)),
        pad_token_id=draw(st.sampled_from((0, 1))),
        max_response_len=width,
        sp_size=sp,
        pad_to_length=bucket,
        pass_cu_seqlens=packed and allow_cu_seqlens and draw(st.booleans()),
        entropy_chunk_size=draw(st.sampled_from((None, None, 1, 2, 3, 7))) if allow_chunking else None,
        head=head,
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def dense_cases(draw, *, max_batch: int = 5, max_len: int = 8) -> DenseCase:
    """A left-padded-prompt, right-padded-response dense batch (with slack columns)."""
    _check_bounds(max_batch=max_batch, max_len=max_len)
    batch = draw(st.integers(1, max_batch))
    prompts = draw(seq_lengths(batch, max_len=max_len))
    responses = draw(seq_lengths(batch, max_len=max_len))
    return DenseCase(
        prompt_lens=prompts, response_lens=responses,
        prompt_width=max(prompts) + draw(st.integers(0, 2)),
        response_width=max(responses) + draw(st.integers(0, 2)),
        mrope=draw(st.booleans()),
        topk=draw(st.sampled_from((0, 1, 3))),
        mask_holes=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
