"""Mini-batch cases for the micro-batch layer: structure only (lengths, groups, budget, settings, a seed).

A :class:`MiniBatchCase` is a trainer's mini-batch on one data-parallel rank (its samples' prompt and
response lengths, the extra per-sample keys it carries) and the settings ``prepare_micro_batches`` reads
(``use_dynamic_bsz``, the token budget ``max_token_len_per_gpu`` x ``sp_size``, ``force_group_size``,
``micro_batch_size_per_gpu``, balancing, ``num_batches_divided_by``, ``min_num_micro_batch``), and, for the
data-parallel invariant, the other ranks' mini-batches. Tensors come from the seed
(:func:`materialize_minibatch`, which builds on :func:`spec.materialize.materialize`).

Length distributions as RL rollouts have them (``style``): ``free``; ``rl`` (many short responses, a few
at the maximum length, as truncated rollouts are); ``groups`` (GRPO: groups of samples sharing one prompt,
responses of any length); ``all_max`` (every response at the maximum: a group whose responses all hit
``max_response_length``, verl #7661); ``equal`` (every sequence of one length). Sizes come in tiers (the
tier shrinks to ``small``): ``small`` (B <= 8, lengths drawn one by one), ``batch`` (B 9..64) and, rarely,
``large`` (B 256..4096); the larger tiers draw their lengths from a seed so a case stays one short line.
The budget is drawn against the lengths, reaching its boundaries on purpose: exactly the longest sample
(or group), exactly the whole mini-batch, in between, above, and (rarely) below the longest sample.
Failures shrink towards ``MiniBatchCase(p=[1] r=[1] budget=2 seed=0)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from ..protocol.profile import POSITIONS
from .materialize import PadMode, jagged, materialize
from .media import fitted_media
from .strategies import ABORTED_ONE_IN, router_replay, seq_lengths, with_aborted_response
from .structure import CONTEXTS, EngineCase, SampleLengths

__all__ = ["MiniBatchCase", "minibatch_cases", "materialize_minibatch", "STYLES", "MB_TIERS", "runs"]

STYLES = ("free", "rl", "groups", "all_max", "equal")
#: ``doubled``: every sequence of one length or twice it (many equal subset sums: ties in a balancer's heap)
TIE_STYLES = (*STYLES, "doubled")
MB_TIERS = ("small", "batch", "large")
#: how the mini-batch holds its samples: ``nested`` (jagged tensors, the no-padding path) or ``padded`` (the
#: rollout's dense batch: left-padded prompts, right-padded responses, an attention mask, as a trainer hands
#: ``prepare_micro_batches`` a left_right batch)
MB_LAYOUTS = ("nested", "padded")
#: what each micro-batch's step returns to ``postprocess_batch_func``: ``model_output`` (a forward-only pass),
#: ``train`` (a training step: model_output, loss and metrics), ``loss_only`` (loss and metrics, no model_output)
MB_OUTPUTS = ("model_output", "train", "loss_only")


def runs(values: tuple[int, ...]) -> str:
    """``[3, 3, 3, 1]`` as ``[3]*3+[1]``: a long length list stays one short line."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(f"[{values[i]}]*{j - i}" if j - i > 2 else ", ".join(str(v) for v in values[i:j]))
        i = j
    text = ", ".join(parts)
    return f"[{text}]" if "*" not in text else "+".join(
        p if p.startswith("[") else f"[{p}]" for p in _merge_plain(parts))


def _merge_plain(parts: list[str]) -> list[str]:
    merged: list[str] = []
    for p in parts:
        if merged and "*" not in p and "*" not in merged[-1]:
            merged[-1] = merged[-1] + ", " + p
        else:
            merged.append(p)
    return merged


@dataclass(frozen=True)
class MiniBatchCase(SampleLengths):
    """One mini-batch and the micro-batch settings it is cut under (structure only)."""

    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    #: ``max_token_len_per_gpu`` (the budget is this times ``sp_size``)
    max_token_len: int = 2
    use_dynamic_bsz: bool = True
    sp_size: int = 1
    balance: bool = True  # use_dynamic_bsz_balance
    num_batches_divided_by: int | None = None
    min_num_micro_batch: int | None = None
    force_group_size: int = 1
    micro_batch_size: int = 1  # micro_batch_size_per_gpu (fixed-size path)
    mrope: bool = False
    topk: int = 0  # teacher top-K tensors (B, j, K); 0 = none
    routed_experts: bool = False  # nested (B, j, layers, top-k) routed experts
    #: the router replay's (experts, MoE layers, top-k) and dtype (verl's agent loop hands int16)
    routed_shape: tuple[int, int, int] = (8, 2, 2)
    routed_dtype: str = "int64"
    per_sample_temperature: bool = False  # a dense (B,) temperature key
    uid: bool = False  # a per-sample NonTensorStack of uids
    calculate_entropy: bool = False
    use_remove_padding: bool = True  # the engine's packed (True) or padded mode (end to end)
    vocab: int = 16
    #: the other data-parallel ranks' mini-batches: one (prompt_lens, response_lens) per rank (DP invariant)
    other_ranks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    style: str = "free"
    #: for mini-batches drawn from a seed (the large tiers): (max_prompt, max_response, group, length seed), which
    #: the case prints instead of its long length lists
    plan: tuple[int, int, int, int] | None = None
    seed: int = 0
    #: the autograd context the layer's calls (and, end to end, the engine and model) run in (``CONTEXTS``)
    context: str = "grad"
    #: how the mini-batch holds its samples (``MB_LAYOUTS``)
    layout: str = "nested"
    #: the trainer's balance_batch over data-parallel ranks: ``get_seqlen_balanced_partitions(lengths,
    #: k_partitions, equal_size)`` (0: not drawn)
    k_partitions: int = 0
    equal_size: bool = False
    #: what each micro-batch's step hands ``postprocess_batch_func`` (``MB_OUTPUTS``)
    outputs: str = "model_output"
    #: a vision-language mini-batch: images and videos inside the prompts (:func:`spec.cases.media.fitted_media`),
    #: ``multi_modal_inputs`` per sample, mRoPE positions from the grids
    media: bool = False

    def __post_init__(self) -> None:
        self._check_lengths()
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")
        if self.layout not in MB_LAYOUTS:
            raise ValueError(f"layout must be one of {MB_LAYOUTS}, got {self.layout!r}")
        if self.outputs not in MB_OUTPUTS:
            raise ValueError(f"outputs must be one of {MB_OUTPUTS}, got {self.outputs!r}")
        if self.equal_size and self.k_partitions and self.batch_size % self.k_partitions:
            raise ValueError(f"equal_size: {self.batch_size} samples do not split into {self.k_partitions} parts")
        if self.media and not self.mrope:
            raise ValueError("a mini-batch with media has mRoPE positions (mrope=True)")

    # -- derived structure (batch_size, seq_lens, total_nnz: SampleLengths) --------------------------
    @property
    def budget(self) -> int:
        """The token budget of one micro-batch: ``max_token_len_per_gpu * sp_size``."""
        return self.max_token_len * self.sp_size

    @property
    def groups_divide(self) -> bool:
        return self.batch_size % self.force_group_size == 0

    @property
    def group_tokens(self) -> tuple[int, ...]:
        g = self.force_group_size
        lens = self.seq_lens
        return tuple(sum(lens[i:i + g]) for i in range(0, len(lens), g))

    @property
    def over_budget(self) -> bool:
        """One sample (or forced group) alone exceeds the budget: the layer must refuse the mini-batch."""
        return max(self.group_tokens) > self.budget

    @property
    def fixed_divides(self) -> bool:
        return self.batch_size % (self.force_group_size * self.micro_batch_size) == 0

    def required_count(self) -> int:
        """The fewest micro-batches the count rules allow when the whole mini-batch fits one budget: 1, raised to
        ``min_num_micro_batch``, rounded up to a multiple of ``num_batches_divided_by``."""
        count = max(1, self.min_num_micro_batch or 1)
        step = self.num_batches_divided_by or 1
        return -(-count // step) * step

    def count_feasible(self) -> bool | None:
        """Whether some micro-batch count k <= the number of groups meets the count rules and the budget (True),
        none does (False: the layer must return empty micro-batches or refuse), or the bounds cannot tell (None).
        A partition into k non-empty micro-batches within the budget exists for every k from the bin-packing
        optimum up to the number of groups; the optimum lies between ceil(total / budget) and first-fit
        decreasing's count."""
        groups, step = self.num_groups, self.num_batches_divided_by or 1
        allowed = [k for k in range(max(1, self.min_num_micro_batch or 1), groups + 1) if k % step == 0]
        if not allowed or self.over_budget:
            return False
        lower = -(-self.total_nnz // self.budget)
        if max(allowed) < lower:
            return False
        return True if max(allowed) >= _first_fit_decreasing(self.group_tokens, self.budget) else None

    @property
    def padded_width(self) -> int:
        """The columns of the padded layout: the longest prompt plus the longest response."""
        return max(self.prompt_lens) + max(self.response_lens)

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.force_group_size

    def engine_case(self) -> EngineCase:
        """The mini-batch's samples as an :class:`EngineCase` (the keys and flags a micro-batch carries)."""
        temps = tuple(0.5 + 0.25 * (i % 7) for i in range(self.batch_size)) if self.per_sample_temperature else 1.0
        return EngineCase(self.prompt_lens, self.response_lens, vocab=self.vocab, temperature=temps, mrope=self.mrope,
                          calculate_entropy=self.calculate_entropy, topk=max(self.topk, 1),
                          use_remove_padding=self.use_remove_padding,
                          distillation_keys=("distillation_losses",) if self.topk else (), seed=self.seed,
                          context=self.context,
                          media=fitted_media(self.prompt_lens, self.seed) if self.media else ())

    def rank_case(self, rank: int) -> "MiniBatchCase":
        """Data-parallel rank ``rank``'s mini-batch (rank 0: this one) under the same settings."""
        if rank == 0:
            return replace(self, other_ranks=())
        prompts, responses = self.other_ranks[rank - 1]
        return replace(self, prompt_lens=prompts, response_lens=responses, other_ranks=(), seed=self.seed + rank)

    @property
    def world(self) -> int:
        return 1 + len(self.other_ranks)

    def with_(self, **changes: object) -> "MiniBatchCase":
        return replace(self, **changes)

    def __repr__(self) -> str:
        if self.plan is not None:
            parts = [f"B={self.batch_size} lengths({self.style}, prompts<={self.plan[0]}, responses<={self.plan[1]}, "
                     f"group={self.plan[2]}, seed={self.plan[3]}) total={self.total_nnz}"]
        else:
            parts = [f"p={runs(self.prompt_lens)}", f"r={runs(self.response_lens)}"]
        if self.use_dynamic_bsz:
            parts.append(f"budget={self.max_token_len}" + (f"x{self.sp_size}" if self.sp_size > 1 else ""))
            if not self.balance:
                parts.append("unbalanced")
            if self.num_batches_divided_by:
                parts.append(f"divided_by={self.num_batches_divided_by}")
            if self.min_num_micro_batch:
                parts.append(f"min_num={self.min_num_micro_batch}")
        else:
            parts.append(f"fixed mbs={self.micro_batch_size}")
        if self.force_group_size > 1:
            parts.append(f"group={self.force_group_size}")
        routed = "routed_experts" + ("" if (self.routed_shape, self.routed_dtype) == ((8, 2, 2), "int64") else
                                     "={}({}x{}{})".format(*self.routed_shape, "" if self.routed_dtype == "int64"
                                                           else " " + self.routed_dtype))
        parts += [name for name, on in (("mrope", self.mrope), ("media", self.media), (routed, self.routed_experts),
                                        ("temperature[B]", self.per_sample_temperature), ("uid", self.uid),
                                        ("entropy", self.calculate_entropy),
                                        ("padded", not self.use_remove_padding)) if on]
        if self.topk:
            parts.append(f"topk={self.topk}")
        if self.vocab != 16:
            parts.append(f"V={self.vocab}")
        for r, (p, q) in enumerate(self.other_ranks, start=1):
            parts.append(f"rank{r}=(p={runs(p)} r={runs(q)})")
        if self.style != "free" and self.plan is None:
            parts.append(self.style)
        if self.layout != "nested":
            parts.append(self.layout)
        if self.k_partitions:
            parts.append(f"partitions={self.k_partitions}" + (" equal_size" if self.equal_size else ""))
        if self.outputs != "model_output":
            parts.append(f"outputs={self.outputs}")
        parts.append(f"seed={self.seed}")
        if self.context != "grad":
            parts.append(self.context)
        return "MiniBatchCase(" + " ".join(parts) + ")"


def micro_batch_rows(micro, indices):
    """Which mini-batch samples each micro-batch holds: the returned index lists (the dynamic path), or consecutive
    chunks of each micro-batch's size (the fixed path: no indices, the order kept). Written out verbatim into the
    micro-batch reproducers (spec/repro/minibatch.py): plain Python over the layer's returns."""
    if indices is not None:
        return [[int(i) for i in part] for part in indices]
    rows, start = [], 0
    for mb in micro:
        size = int(mb.batch_size[0]) if mb.batch_size else 0
        rows.append(list(range(start, start + size)))
        start += size
    return rows


def _first_fit_decreasing(sizes: tuple[int, ...], budget: int) -> int:
    bins: list[int] = []
    for size in sorted(sizes, reverse=True):
        for i, used in enumerate(bins):
            if used + size <= budget:
                bins[i] += size
                break
        else:
            bins.append(size)
    return len(bins)


# -- strategies ----------------------------------------------------------------------------------------

@st.composite
def _mb_tier(draw, large: bool) -> str:
    """``small`` unless two coin flips come up (1/4); then ``batch``, or (one in six of those, where allowed)
    ``large``: about four large mini-batches in a 100-example ``ci`` run."""
    if draw(st.booleans()) and draw(st.booleans()):
        return "large" if large and draw(st.integers(0, 5)) == 0 else "batch"
    return "small"


def _seeded_lengths(style: str, batch: int, max_prompt: int, max_response: int, group: int, seed: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Prompt and response lengths of a large mini-batch, from ``seed`` (vectorised, no loop over samples)."""
    gen = torch.Generator().manual_seed(seed)
    if style in ("equal", "doubled"):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=gen))
        if style == "doubled":
            twice = torch.rand(batch, generator=gen) < 0.5
            return (p,) * batch, tuple(torch.where(twice, torch.full((batch,), 3 * p), torch.full((batch,), p)).tolist())
        r = int(torch.randint(1, max_response + 1, (1,), generator=gen))
        return (p,) * batch, (r,) * batch
    groups = -(-batch // group)
    prompts = torch.randint(1, max_prompt + 1, (groups,), generator=gen).repeat_interleave(group)[:batch]
    if style == "free":
        prompts = torch.randint(1, max_prompt + 1, (batch,), generator=gen)
    if style == "all_max":
        responses = torch.full((batch,), max_response)
    else:
        short = torch.randint(1, max(2, max_response // 8) + 1, (batch,), generator=gen).clamp(max=max_response)
        free = torch.randint(1, max_response + 1, (batch,), generator=gen)
        at_max = torch.rand(batch, generator=gen) < (0.1 if style == "rl" else 0.02)
        responses = torch.where(at_max, torch.full_like(free, max_response), short if style == "rl" else free)
    return tuple(prompts.tolist()), tuple(responses.tolist())


@st.composite
def _lengths(draw, tier: str, group: int, groups: int, styles: tuple[str, ...] = STYLES
             ) -> tuple[tuple[int, ...], tuple[int, ...], str, tuple | None]:
    batch = group * groups
    style = draw(st.sampled_from(styles))
    if tier == "small":
        max_len = 8
        responses = draw(seq_lengths(batch, max_len=max_len))
        if style == "equal":
            prompts = (draw(st.integers(1, max_len)),) * batch
            responses = (responses[0],) * batch
        elif style == "doubled":  # sequence lengths 2u or 4u: prompts of u, responses of u or 3u
            unit = draw(st.integers(1, max_len // 3))
            prompts = (unit,) * batch
            responses = tuple(unit if draw(st.booleans()) else unit * 3 for _ in range(batch))
        elif style in ("groups", "all_max"):
            per_group = draw(st.lists(st.integers(1, max_len), min_size=groups, max_size=groups))
            prompts = tuple(p for p in per_group for _ in range(group))
            if style == "all_max":
                responses = (max_len,) * batch
        elif style == "rl":  # many short responses and one at the longest, after one short prompt (a rollout's shape)
            prompts = (draw(st.integers(1, 2)),) * batch
            longest = draw(st.integers(0, batch - 1))
            responses = tuple(max_len if i == longest else min(r, 2) for i, r in enumerate(responses))
        else:
            prompts = draw(seq_lengths(batch, max_len=max_len))
        return prompts, responses, style, None
    max_prompt = draw(st.sampled_from((4, 16)))
    max_response = draw(st.sampled_from((8, 32)))
    plan = (max_prompt, max_response, max(group, draw(st.integers(1, 8))), draw(st.integers(0, 2 ** 16)))
    prompts, responses = _seeded_lengths(style, batch, *plan)
    return prompts, responses, style, plan


@st.composite
def _budget(draw, seq_lens: tuple[int, ...], group: int, sp: int, allow_over: bool) -> int:
    """``max_token_len_per_gpu`` for ``sp`` ranks, against the lengths: at the longest sample/group exactly, the whole
    mini-batch exactly, in between, above it, or (``allow_over``, rarely) below the longest group."""
    group_tokens = [sum(seq_lens[i:i + group]) for i in range(0, len(seq_lens), group)]
    longest, total = max(group_tokens), sum(seq_lens)
    kind = draw(st.sampled_from(("longest", "total", "between", "between", "above", "over")
                                if allow_over else ("longest", "total", "between", "between", "above")))
    if kind == "longest":
        target = longest
    elif kind == "total":
        target = total
    elif kind == "between":
        target = draw(st.integers(longest, max(longest, total)))
    elif kind == "above":
        target = total + draw(st.integers(1, 8))
    else:
        return max(1, (longest - draw(st.integers(1, max(1, longest - 1)))) // sp) if longest > 1 else 1
    return -(-target // sp)


@st.composite
def minibatch_cases(draw, *, dynamic: bool | None = None, allow_over: bool = False, allow_large: bool = False,
                    max_groups: int = 8, extras: bool = True, world: int = 1, max_group_size: int = 4,
                    fixed_divides: bool | None = True, count_rules: bool = True, refusals: bool = False,
                    min_group_size: int = 1, allow_topk: bool = True, allow_temperature: bool = True,
                    positions: tuple[str, ...] = POSITIONS, styles: tuple[str, ...] = STYLES,
                    layouts: tuple[str, ...] = ("nested",), partitions: bool = False,
                    outputs: tuple[str, ...] = ("model_output",), media: tuple[str, ...] = ()) -> MiniBatchCase:
    """A :class:`MiniBatchCase`.

    ``positions``: the position kinds the engine's profile accepts (mRoPE drawn only where both are). ``media``: the
    media kinds its profile lists; with both, two mRoPE mini-batches in three carry images and videos (drawn last).
    ``dynamic``: pin the dynamic (token budget) or fixed-size path (None draws it). ``allow_over``: budgets below
    the longest sample/group too. ``extras``: mRoPE, teacher top-K, routed experts, a per-sample temperature, uids.
    ``world`` > 1: the other data-parallel ranks' mini-batches as well (same settings, their own lengths).
    ``fixed_divides``: on the fixed path, B divisible by ``force_group_size * micro_batch_size`` (True), not
    (False), or either (None). ``count_rules``: draw ``num_batches_divided_by`` and ``min_num_micro_batch``;
    ``refusals=False`` keeps only count rules some count within the groups certainly meets (the others are
    dropped), so only the invariants on refusals see mini-batches the layer may refuse.
    """
    tier = draw(_mb_tier(allow_large))
    group = draw(st.sampled_from(tuple(range(1, max_group_size + 1)))) if draw(st.booleans()) else 1
    group = max(group, min_group_size)
    if tier == "small":
        groups = draw(st.integers(1, max_groups))
    elif tier == "batch":
        groups = max(1, draw(st.integers(9, 32)) // group)
    else:
        groups = max(1, (draw(st.sampled_from((256, 512, 1024, 2048))) + draw(st.integers(0, 255))) // group)
    prompts, responses, style, plan = draw(_lengths(tier, group, groups, styles))
    layout = draw(st.sampled_from(layouts))
    dynamic = draw(st.booleans()) if dynamic is None else dynamic
    sp = draw(st.sampled_from((1, 1, 1, 2, 4)))
    seq = tuple(p + r for p, r in zip(prompts, responses))
    budget = draw(_budget(seq, group, sp, allow_over)) if dynamic else max(seq)
    if tier == "large" and dynamic:  # at most ~16 micro-batches: a large case stays a second, not a minute
        budget = max(budget, -(-sum(seq) // (16 * sp)))
    mbs = 1
    if not dynamic:
        divisors = [m for m in range(1, groups + 1) if groups % m == 0]
        if fixed_divides is None:
            fixed_divides = draw(st.booleans())
        if fixed_divides:
            mbs = draw(st.sampled_from(divisors))
        else:
            others = [m for m in range(2, groups + 2) if groups % m]
            if not others:  # groups == 1: any mbs > 1 does not divide
                others = [2]
            mbs = draw(st.sampled_from(others))
    divided_by = min_num = None
    if dynamic and count_rules:
        if draw(st.booleans()):
            divided_by = draw(st.integers(2, 4))
        if draw(st.booleans()):
            min_num = draw(st.integers(1, 4))
    mrope = topk = routed = temps = uid = False
    mrope = positions == ("mrope",)  # an mRoPE-only engine: every mini-batch carries mRoPE positions
    routed_shape, routed_dtype = (8, 2, 2), "int64"
    if extras and tier != "large" and layout == "nested":  # a large mini-batch carries the trainer's keys only (cost)
        mrope, routed, temps, uid = (draw(st.booleans()) for _ in range(4)) if len(set(positions)) > 1 else \
            ("mrope" in positions, *(draw(st.booleans()) for _ in range(3)))
        if routed:
            routed_shape, routed_dtype = draw(router_replay())
        topk = draw(st.sampled_from((0, 0, 1, 3))) if allow_topk else 0
        temps = temps and allow_temperature
    others = []
    for _ in range(world - 1):
        o_prompts, o_responses, _, _ = draw(_lengths("small", group, draw(st.integers(1, max_groups))))
        others.append((o_prompts, o_responses))
    if others:  # every rank's samples fit its budget (the DP invariant is about the count, not the refusal)
        longest = max(sum((p + r) for p, r in zip(o[0][i:i + group], o[1][i:i + group]))
                      for o in [(prompts, responses), *others] for i in range(0, len(o[0]), group))
        budget = max(budget, -(-longest // sp))
    case = MiniBatchCase(prompts, responses, max_token_len=budget, use_dynamic_bsz=dynamic, sp_size=sp,
                         balance=draw(st.booleans()) if dynamic else True, num_batches_divided_by=divided_by,
                         min_num_micro_batch=min_num, force_group_size=group, micro_batch_size=mbs, mrope=mrope,
                         topk=int(topk), routed_experts=routed, routed_shape=routed_shape,
                         routed_dtype=routed_dtype, per_sample_temperature=temps, uid=uid,
                         other_ranks=tuple(others), style=style, plan=plan, seed=draw(st.integers(0, 2 ** 16)),
                         layout=layout, k_partitions=draw(_partitions(len(prompts))) if partitions else 0,
                         outputs=draw(st.sampled_from(outputs)),
                         context=draw(st.sampled_from(CONTEXTS)))  # drawn last: shrinks to grad
    if partitions and case.batch_size % case.k_partitions == 0:
        case = case.with_(equal_size=draw(st.booleans()))
    if case.plan is None and case.style in ("free", "rl"):  # lengths drawn one by one: an aborted rollout among them
        case = with_aborted_response(case, draw(st.integers(0, ABORTED_ONE_IN - 1)))
    if dynamic and not refusals and not case.over_budget and any(
            case.rank_case(r).count_feasible() is not True for r in range(case.world)):
        case = case.with_(num_batches_divided_by=None, min_num_micro_batch=None)
    if case.mrope and set(media) >= {"image", "video"} and case.vocab >= 8 and draw(st.integers(0, 2)) != 0:
        case = case.with_(media=True)
    return case


@st.composite
def _partitions(draw, batch: int) -> int:
    """k from 1 to B (the data-parallel world size): half the time a proper divisor of B where it has one (an
    equal split that is not trivial: a trainer's balance_batch asks one), else 1, 2, the batch size itself, or any
    between."""
    proper = [d for d in range(2, batch) if batch % d == 0]
    if proper and draw(st.booleans()):
        return draw(st.sampled_from(proper))
    return draw(st.sampled_from(sorted({1, min(2, batch), batch}))) if draw(st.booleans()) else \
        draw(st.integers(1, batch))


# -- tensors ---------------------------------------------------------------------------------------------

#: the flags and settings prepare_micro_batches reads off the mini-batch (NonTensorData)
SETTING_KEYS = ("use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu", "force_group_size", "sp_size")


def materialize_minibatch(case: MiniBatchCase, device: torch.device | str = "cpu") -> TensorDict:
    """The mini-batch of ``case``: the micro-batch keys of :func:`spec.materialize.materialize` for all its samples
    (nested ids, positions (2-D or mRoPE), prompts, responses, masks, teacher top-K when asked, the engine flags),
    plus nested ``routed_experts`` ``(B, j, layers, top-k)`` of the case's experts and dtype, a per-sample ``uid`` NonTensorStack, and the settings
    ``prepare_micro_batches`` reads, as NonTensorData (verl's ``tu.assign_non_tensor``), ``force_group_size`` only
    where it forces groups (> 1: no caller in verl 0.9.1 sets it, so the layer reads its default)."""
    td = materialize(case.engine_case(), device)
    if not case.topk:
        for key in ("teacher_ids", "teacher_logprobs"):
            if key in td.keys():
                del td[key]
    elif td["teacher_ids"].values().shape[-1] != case.topk:
        raise ValueError(f"teacher top-K {td['teacher_ids'].values().shape[-1]}, case asks {case.topk}")
    if case.routed_experts:
        gen = torch.Generator().manual_seed(case.seed + 1)
        experts, layers, top_k = case.routed_shape
        values = torch.randint(0, experts, (case.total_nnz, layers, top_k), generator=gen)
        values = values.to(device=device, dtype=getattr(torch, case.routed_dtype))
        td.set("routed_experts", jagged(values, case.seq_lens))
    if case.uid:
        td.set("uid", NonTensorStack(*[f"u{i // case.force_group_size}-{i}" for i in range(case.batch_size)]))
    settings = {"use_dynamic_bsz": case.use_dynamic_bsz, "max_token_len_per_gpu": case.max_token_len,
                "micro_batch_size_per_gpu": case.micro_batch_size, "force_group_size": case.force_group_size,
                "sp_size": case.sp_size}
    for key, value in settings.items():
        if key == "force_group_size" and value == 1:  # as verl 0.9.1's callers hand it: none sets the key, the
            continue                                  # layer reads its default (1)
        td.set_non_tensor(key, value)
    return padded_minibatch(case, td) if case.layout == "padded" else td


def _to_dense(value: torch.Tensor, lengths: torch.Tensor, width: int, starts: torch.Tensor) -> torch.Tensor:
    """A nested tensor (ragged at 1, or mRoPE ``(B, 4, j)`` ragged at 2) as a dense one: sample i's tokens in columns
    ``starts[i]`` .. ``starts[i] + lengths[i] - 1`` of ``width``, zeros elsewhere (no loop over the samples)."""
    ragged = getattr(value, "_ragged_idx", 1)
    values = value.values()
    batch = lengths.numel()
    row = torch.repeat_interleave(torch.arange(batch), lengths)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    col = torch.arange(int(lengths.sum())) - offsets[row] + starts[row]
    if ragged == 2:  # (C, total) -> (B, C, width)
        out = values.new_zeros((batch, values.shape[0], width))
        out[row, :, col] = values.transpose(0, 1)
        return out
    out = values.new_zeros((batch, width, *values.shape[1:]))
    out[row, col] = values
    return out


def padded_minibatch(case: MiniBatchCase, td: TensorDict) -> TensorDict:
    """The nested mini-batch ``td`` as the rollout's padded batch: every nested key dense, a prompt-long key
    left-padded to the longest prompt, a response-long key right-padded to the longest response, a whole-sequence
    key left-right padded (its prompt ending at the longest prompt's column); ``attention_mask`` ``(B, P + R)`` int64
    marks the real tokens; ``pad_mode`` is ``left_right``. Dense keys, stacks and other flags are kept."""
    prompts = torch.tensor(case.prompt_lens, dtype=torch.int64)
    responses = torch.tensor(case.response_lens, dtype=torch.int64)
    max_p, max_r = int(prompts.max()), int(responses.max())
    seq = prompts + responses
    out = TensorDict({}, batch_size=td.batch_size, device=td.device)
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            lengths = value.offsets().diff().cpu()
            if torch.equal(lengths, seq):
                out.set(key, _to_dense(value, lengths, max_p + max_r, max_p - prompts))
            elif torch.equal(lengths, prompts):
                out.set(key, _to_dense(value, lengths, max_p, max_p - prompts))
            else:
                out.set(key, _to_dense(value, lengths, max_r, torch.zeros_like(lengths)))
        elif key != "pad_mode":
            out.set(key, value)
    out.set_non_tensor("pad_mode", PadMode.LEFT_RIGHT)
    cols = torch.arange(max_p + max_r)
    starts = (max_p - prompts).unsqueeze(1)
    out.set("attention_mask", ((cols >= starts) & (cols < starts + seq.unsqueeze(1))).to(torch.int64).to(td.device))
    return out
