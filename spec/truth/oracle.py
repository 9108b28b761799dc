"""Expectations computed per sequence, as plainly as possible, with the tolerance each one allows.

The oracle runs the model stand-in on each sequence alone (no padding, no packing) and reads
every quantity straight off the contract, in float64 from the scaled logits on. Memory stays
bounded: one sequence's ``(n_i, V)`` logits at a time (the strategies bound ``n x V``).

Tolerance rule (the arithmetic, not a fudge): the model's logits are exact numbers of their dtype
(float32, bfloat16 or float16); the contract upcasts them, divides by the float32 temperature
(clamped at 1e-8) and computes in float32, so the error budget is float32's ``eps = 2**-23``
whatever the logits' dtype. The oracle uses the same float32 scaled logits ``z`` and computes the
rest in float64. A correct float32 evaluation of ``f(z)`` (rounding ``z`` itself included, for
engines that scale differently) is off by at most about ``eps * (cond_f + (1 + |f|) * log2(V + 1))``
where ``cond_f = sum_j |df/dz_j| * |z_j|`` is ``f``'s condition in ``z``:

- log-prob of label ``y``: ``cond = |z_y| + sum_j p_j |z_j|``;
- entropy ``H``: ``cond = sum_j p_j |log p_j + H| |z_j|``;
- ``sum_pi_squared`` ``S``: ``cond = sum_j 2 p_j |p_j - S| |z_j|``;
- the distillation terms: ``(max_j |z_j| + 1) * (1 + K)``; the value head: ``|v|``.

The allowed error is :data:`SAFETY` (32) times that, per token. It grows with ``|z| = |logits| / T``
where the math is ill-conditioned, and stays tight where it is not: a log-softmax computed in
bfloat16 (``2**15`` times float32's eps), or an entropy computed as ``logsumexp - sum(p * z)`` at low
temperature (off by ``eps * max|z|`` where the condition is ~0), is outside it.

An engine that declares a lower precision for an output (``spec.protocol.Precision``: the scaled logits rounded to
``scaled_in``, the result to ``returns``) is compared at it (:meth:`Expected.at_precision`): the oracle's value
rounded to ``returns``, and on top of the float32 budget :data:`LOW_SAFETY` (4) times that dtype's unit roundoff
``u`` of what a correct evaluation at that precision rounds: ``u_scaled * cond_f`` (each ``z_j`` off by
``u |z_j|``) plus ``u_returns * (1 + |f|)`` (the result rounded). So a correct bf16 log-softmax passes and a
mistake beyond bf16's rounding (a temperature applied twice, a wrong label, a cancelling formula) still fails.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from ..protocol.profile import drawn_config
from .rules import TEMPERATURE_FLOOR, response_positions, token_temperatures
from .toy_model import ToyCausalLM

__all__ = ["Expected", "expected", "expected_loop", "LAYOUT_ONLY", "oracle_key", "topk_terms", "LOG_PROB_MIN_CLAMP",
           "log_prob_min_clamp", "topk_tie_slack", "OVERLAP_KEYS", "TopKProcessor", "scaled_logits", "EPS", "SAFETY",
           "LOW_SAFETY", "unit_roundoff"]

EPS = torch.finfo(torch.float32).eps
SAFETY = 32.0
#: the safety factor on a declared lower precision's rounding (module doc)
LOW_SAFETY = 4.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def unit_roundoff(dtype: str) -> float:
    """The unit roundoff of ``dtype`` beyond float32's budget: 0 for float32 and float64 (covered by :data:`SAFETY`),
    ``eps / 2`` for bfloat16 (2**-8) and float16 (2**-11)."""
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; dtypes: {sorted(_DTYPES)}")
    return 0.0 if dtype in ("float32", "float64") else torch.finfo(_DTYPES[dtype]).eps / 2


#: the engine configuration switch (``EngineCase.engine_config``) the oracle reads: verl's
#: ``distillation_loss.log_prob_min_clamp``, the floor both top-K log-probs are clamped at before the KL terms
LOG_PROB_MIN_CLAMP = "log_prob_min_clamp"


def log_prob_min_clamp(case: object) -> float | None:
    """The drawn ``log_prob_min_clamp`` of ``case`` (:data:`LOG_PROB_MIN_CLAMP`), None where it has none."""
    value = drawn_config(case).get(LOG_PROB_MIN_CLAMP)
    return None if value is None else float(value)


def topk_terms(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
               log_prob_min_clamp: float | None = None) -> dict[str, torch.Tensor]:
    """Per-token top-K distillation terms from ``(n, V)`` logits and ``(n, K)`` teacher top-K, with verl's
    definitions (``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``), in float64: ``q`` the
    student's log-probs at the teacher's ids, ``p`` the teacher's log-probs (both clamped below at
    ``log_prob_min_clamp`` where given, after the masses), ``kl_j = exp(p_j) (p_j - q_j)``:

    * ``distillation_losses = sum_j kl_j``; ``student_mass = sum_j exp(q_j)``, ``teacher_mass = sum_j exp(p_j)``
      (unclamped);
    * ``overlap_count``: how many teacher ids are among the student's own top-K (``K = min(K, V)``);
    * ``overlap_token_advantage = -sum_{j overlapping} kl_j / overlap_count`` (0 where nothing overlaps).

    The student's top-K is ranked on the logits as given (float32 in the processor and the oracle alike), so
    near-ties break the same way in both."""
    student = torch.log_softmax(student_logits.double(), dim=-1)
    at_teacher = student.gather(-1, teacher_ids)
    teacher_logprobs = teacher_logprobs.double()
    student_mass, teacher_mass = at_teacher.exp().sum(-1), teacher_logprobs.exp().sum(-1)
    if log_prob_min_clamp is not None:
        at_teacher = at_teacher.clamp_min(log_prob_min_clamp)
        teacher_logprobs = teacher_logprobs.clamp_min(log_prob_min_clamp)
    token_kl = teacher_logprobs.exp() * (teacher_logprobs - at_teacher)
    k = teacher_ids.shape[-1]
    count, advantage = _overlap_terms(_overlap(student_logits, teacher_ids), token_kl)
    return {
        "distillation_losses": token_kl.sum(-1),
        "student_mass": student_mass,
        "teacher_mass": teacher_mass,
        "overlap_count": count,
        "overlap_token_advantage": advantage,
    }


def _overlap(student_logits: torch.Tensor, teacher_ids: torch.Tensor) -> torch.Tensor:
    """``(n, K)`` bool: which teacher ids are among the student's top-K of ``student_logits``."""
    k = min(teacher_ids.shape[-1], student_logits.shape[-1])
    student_top = student_logits.topk(k, dim=-1).indices
    return (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)


def _overlap_terms(overlap: torch.Tensor, token_kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``overlap_count`` and ``overlap_token_advantage`` of an overlap mask (``(..., K)``) and the KL terms."""
    count = overlap.to(token_kl.dtype).sum(-1)
    advantage = (-token_kl * overlap).sum(-1) / count.clamp(min=1)
    return count, torch.where(count > 0, advantage, torch.zeros_like(advantage))


#: the keys whose value depends on which ids make the student's top-K (a discontinuous function of the logits)
OVERLAP_KEYS = ("overlap_count", "overlap_token_advantage")


def topk_tie_slack(z: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                   log_prob_min_clamp: float | None, dtype: str) -> dict[str, torch.Tensor]:
    """Per token, how far :data:`OVERLAP_KEYS` can move when the student's top-K is ranked on the scaled logits
    (or their log-softmax) rounded to ``dtype`` rather than in float32: a teacher id whose ``z`` lies within that
    rounding (``LOW_SAFETY * u * (|z_j| + |z_(K)| + |z_j - lse| + |z_(K) - lse|)``) of the K-th or (K+1)-th
    largest may tie with it and fall either side. The slack is the largest change of the count and of the
    advantage over every overlap set such ties allow (the certain members plus any subset of the ambiguous
    ids: at most ``2**K`` sets), 0 where nothing is ambiguous; ``z`` is the float64 ``(n, V)`` scaled logits."""
    n, vocab = z.shape
    k = teacher_ids.shape[-1]
    zero = z.new_zeros(n)
    u = unit_roundoff(dtype)
    if k >= vocab or not u:
        return {"overlap_count": zero, "overlap_token_advantage": zero}
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    top = z.topk(k + 1, dim=-1).values
    kth, after = top[:, k - 1:k], top[:, k:k + 1]
    at = z.gather(-1, teacher_ids)
    delta = LOW_SAFETY * u * (at.abs() + kth.abs() + (at - lse).abs() + (kth - lse).abs())
    ambiguous = (at >= after - delta) & (at <= kth + delta)
    student = z - lse
    teacher = teacher_logprobs.double()
    q = student.gather(-1, teacher_ids)
    if log_prob_min_clamp is not None:
        q, teacher = q.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    token_kl = teacher.exp() * (teacher - q)
    overlap = _overlap(z.float(), teacher_ids)
    count, advantage = _overlap_terms(overlap, token_kl)
    bits = (torch.arange(2 ** k).unsqueeze(-1) >> torch.arange(k)) & 1  # (2**K, K): every subset
    sets = torch.where(ambiguous, bits.bool().unsqueeze(1), overlap)  # (2**K, n, K)
    counts, advantages = _overlap_terms(sets, token_kl.unsqueeze(0))
    return {"overlap_count": (counts - count).abs().amax(0), "overlap_token_advantage": (advantages - advantage).abs().amax(0)}


class TopKProcessor:
    """A ``logits_processor_func`` returning ``keys`` of :func:`topk_terms`, ``(1, total_nnz)`` float32 each.

    It aligns the teacher tensors with the whole packed row, so it refuses logits of
    any other length (a static bucket or a shard would misalign them).
    """

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys

    def __call__(self, student_logits: torch.Tensor, data: TensorDict, **_: object) -> dict[str, torch.Tensor]:
        teacher_ids = data["teacher_ids"].values()
        teacher_lp = data["teacher_logprobs"].values()
        if student_logits.dim() != 3 or student_logits.shape[:2] != (1, teacher_ids.shape[0]):
            raise ValueError(f"student_logits {tuple(student_logits.shape)} do not align with teacher "
                             f"tensors of {teacher_ids.shape[0]} tokens")
        terms = topk_terms(student_logits[0].float(), teacher_ids, teacher_lp)
        return {key: terms[key].float().unsqueeze(0) for key in self.keys}


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The contract's ``z``: logits upcast to float32 over the float32 temperature clamped at 1e-8."""
    temp = torch.tensor(temperature, dtype=torch.float32).clamp(min=TEMPERATURE_FLOOR)
    return logits.float() / temp


def _softmax_terms(z32: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 terms every statistic and tolerance of the scaled logits ``z32`` reads: ``z``, the vocabulary, the
    log-softmax, the probabilities, ``|z|`` and ``sum_j p_j |z_j|``."""
    z = z32.double()
    lsm = torch.log_softmax(z, dim=-1)
    probs = lsm.exp()
    absz = z.abs()
    return z, z.shape[-1], lsm, probs, absz, (probs * absz).sum(-1)


@dataclass
class Expected:
    """Per-sequence expectations (lists indexed by sample), float64, each with its per-token tolerance."""

    log_probs: list[torch.Tensor] = field(default_factory=list)  # (n_i - 1,): the last token has no label
    entropy: list[torch.Tensor] = field(default_factory=list)  # (n_i,)
    sum_pi_squared: list[torch.Tensor] = field(default_factory=list)
    distillation: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    values: list[torch.Tensor] = field(default_factory=list)
    #: key -> per-sequence allowed absolute error (same shapes as the values)
    tolerance: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: mechanism -> key -> per-sequence bound on the error that mechanism can cause (a known deviation's
    #: excuse reaches no further): ``"float32_cancellation"`` for entropy and sum_pi_squared (and
    #: ``"bfloat16_cancellation"``/``"float16_cancellation"`` for such logits)
    #: (:func:`cancellation_bounds`)
    bounds: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    #: key -> per-sequence condition ``cond_f`` of the value in the scaled logits (module doc)
    condition: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: dtype -> key -> per-sequence slack of :data:`OVERLAP_KEYS` for an engine ranking the student's top-K in that
    #: (lower) dtype (:func:`topk_tie_slack`); added by :meth:`at_precision` where ``scaled_in`` is that dtype
    ties: dict[str, dict[str, list[torch.Tensor]]] = field(default_factory=dict)

    def at_precision(self, key: str, returns: str = "float32", scaled_in: str = "float32"
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Output ``key``'s per-sequence expectation and tolerance for an engine computing it from scaled logits in
        ``scaled_in`` and returning it in ``returns`` (the module doc's rule); float32 gives :meth:`of` and
        :attr:`tolerance` as they are."""
        wants, tols = self.of(key), self.tolerance[key]
        u_scaled, u_returns = unit_roundoff(scaled_in), unit_roundoff(returns)
        if not (u_scaled or u_returns):
            return wants, tols
        conds = self.condition[key]
        rounded = [w.to(_DTYPES[returns]).double() for w in wants]
        extra = [t + LOW_SAFETY * (u_scaled * c + u_returns * (1.0 + w.abs())) for t, c, w in zip(tols, conds, wants)]
        slack = self.ties.get(scaled_in, {}).get(key)
        if slack is not None:
            extra = [t + s for t, s in zip(extra, slack)]
        return rounded, extra

    def of(self, key: str) -> list[torch.Tensor]:
        """The per-sequence expectation of output ``key``."""
        if key in ("log_probs", "entropy", "sum_pi_squared", "values"):
            return getattr(self, key)
        return self.distillation[key]

    def response_log_probs(self, case: "EngineCase", log_probs: list[torch.Tensor] | None = None,
                           tolerance: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, response_width)`` log-prob of each response token (zero past ``r_i``), and its tolerance (of
        ``log_probs``/``tolerance`` where given: those of :meth:`at_precision`)."""
        log_probs = self.log_probs if log_probs is None else log_probs
        tolerance = self.tolerance["log_probs"] if tolerance is None else tolerance
        out = torch.zeros(case.batch_size, case.response_width, dtype=torch.float64)
        tol = torch.zeros_like(out)
        for i, (start, stop) in enumerate(response_positions(case.prompt_lens, case.response_lens)):
            begin = start - (sum(case.seq_lens[:i]))  # the slice within sequence i
            out[i, : stop - start] = log_probs[i][begin: begin + stop - start]
            tol[i, : stop - start] = tolerance[i][begin: begin + stop - start]
        return out, tol


def _bound(cond: torch.Tensor, value: torch.Tensor, vocab: int) -> torch.Tensor:
    return SAFETY * EPS * (cond + (1.0 + value.abs()) * math.log2(vocab + 1))


#: the factor on float32's eps in :func:`cancellation_bounds` (the mechanism's rounding, a small margin)
CANCELLATION_SAFETY = 4.0


def cancellation_bounds(z: torch.Tensor, probs: torch.Tensor, spq: torch.Tensor | None = None,
                        dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Per token, the largest error a float32 evaluation that cancels two large terms can make (what a
    record for that deviation may excuse, and no more), from the float64 ``z`` (n, V) and softmax ``probs``:

    - entropy as ``logsumexp(z) - sum(p * z)``: each term is off by about ``eps * |term|`` times the
      growth of rounding over a float32 reduction of V terms, ``max(sqrt(V), log2(V + 1))`` (blocked or
      sequential accumulation: a random walk of V roundings; pairwise: log2 V), plus the evaluation's own
      roundings around the reduction (each exponential, the logarithm, the subtraction of the maximum: two
      more units, what a vocabulary of 2 shows in bfloat16: 1.26x and 1.46x the bound without them), so
      ``g = max(sqrt(V), log2(V + 1)) + 2``; and a logsumexp is off by one unit more whatever its size: the
      log of its rounded sum (at least 1, the maximum's term) errs by ``eps`` times that sum's growth, not by a
      share of the result (float16 logits ``(-0.0115, -4.19)``: logsumexp 0.015, sum_pi_squared 2.6x the bound
      without it), so
      ``|error| <= c * eps * g * (|logsumexp z| + 1 + sum p |z|)``;
    - sum_pi_squared as ``exp(logsumexp(2z) - 2 logsumexp(z))``: the exponent is off by ``d = c * eps * g *
      (|logsumexp 2z| + 1 + 2 (|logsumexp z| + 1))``, the result by ``S * expm1(d)``;

    with ``c`` = :data:`CANCELLATION_SAFETY`. A float32 cancellation cannot make a NaN, nor an error beyond
    these: at T = 0.05 over 152,064 tokens with logits of a few units they are about 2% of the entropy and 7%
    of sum_pi_squared, so a value 10x off is far outside them.

    ``dtype``: the same evaluation with its terms and reductions in ``dtype`` (``eps`` that dtype's: 2**-7 for
    bfloat16, 2**-10 for float16), the mechanism ``"<dtype>_cancellation"`` of an engine that computes in the
    logits' own dtype (:func:`expected` derives it for a case's bf16/fp16 logits)."""
    vocab = z.shape[-1]
    depth = (max(math.sqrt(vocab), math.log2(vocab + 1)) + 2) * CANCELLATION_SAFETY * torch.finfo(_DTYPES[dtype]).eps
    lse = torch.logsumexp(z, dim=-1)
    out = {"entropy": depth * (lse.abs() + 1 + (probs * z.abs()).sum(-1))}
    if spq is not None:
        lse2 = torch.logsumexp(2 * z, dim=-1)
        out["sum_pi_squared"] = spq * torch.expm1(depth * (lse2.abs() + 1 + 2 * (lse.abs() + 1)))
    return out


#: the fields of a case :func:`expected` never reads, each with the value :func:`oracle_key` gives it: how the engine
#: lays the tokens out and runs (packed or padded, the tail bucket, sequence parallelism and its groups, the entropy
#: chunk, cu_seqlens handed or not, the pad id, the response width, the execution context). Cases that differ only
#: there have one expectation (tests/test_oracle.py changes each on drawn cases and compares the oracle bit for bit).
LAYOUT_ONLY: dict[str, object] = {
    "use_remove_padding": True, "pass_cu_seqlens": False, "pad_to_length": None, "sp_size": 1, "topology": None,
    "entropy_chunk_size": None, "max_response_len": None, "pad_token_id": 0, "context": "grad",
}


def oracle_key(case: "EngineCase") -> "EngineCase":
    """``case`` with every field the oracle never reads at one value (:data:`LAYOUT_ONLY`; of the engine's own
    switches only ``log_prob_min_clamp``, which the distillation terms read): cases with equal keys have equal
    :func:`expected` (from the same model), so one example's checks share it (:meth:`spec.execute.memo.Runs.oracle`)."""
    config = tuple((name, value) for name, value in case.engine_config if name == LOG_PROB_MIN_CLAMP)
    return dataclasses.replace(case, engine_config=config, **LAYOUT_ONLY)


def expected(case: "EngineCase", model: ToyCausalLM, tokens) -> Expected:
    """Everything the contract says the engine returns for ``case``, sequence by sequence (entropy and
    sum_pi_squared only when the case asks for them), from the case's own draws ``tokens``
    (:class:`spec.materialize.Draws`: flat ids, positions and teacher top-K; never a batch an engine was
    handed).

    Vectorised over the tokens of all sequences: each row's quantities are row-wise functions of that
    token's logits (of its sequence alone, :meth:`ToyCausalLM.sequence_logits`), so every value equals that
    of :func:`expected_loop`, the plain per-sequence loop kept as the reference (tests/test_oracle.py
    checks them equal, bit for bit)."""
    lens = case.seq_lens
    ids = tokens.ids
    logits = model.sequence_logits(ids, tokens.position_ids(case), lens, **_media_of(tokens))
    result = Expected(distillation={key: [] for key in case.distillation_keys})
    tol, conds = result.tolerance, result.condition
    for key in ("log_probs", "entropy", "sum_pi_squared", "values", *case.distillation_keys):
        tol[key] = []
        conds[key] = []
    split = lambda t: list(t.split(lens))  # noqa: E731 - per sequence, as views
    if case.head == "value":
        values = logits[:, 0].double()
        result.values, tol["values"] = split(values), split(_bound(values.abs(), values, 1))
        conds["values"] = split(values.abs())
        return result
    temps = token_temperatures(case).clamp(min=TEMPERATURE_FLOOR)
    z32 = logits.float() / temps.unsqueeze(-1)
    z, vocab, lsm, probs, absz, mean_abs = _softmax_terms(z32)
    # each token's label is the next token of its sequence; a sequence's last token has none (dropped below)
    labels = torch.roll(ids, -1).unsqueeze(-1)
    lp = lsm.gather(-1, labels).squeeze(-1)
    lp_cond = absz.gather(-1, labels).squeeze(-1) + mean_abs
    lp_tol = _bound(lp_cond, lp, vocab)
    result.log_probs = [t[:-1] for t in split(lp)]
    tol["log_probs"] = [t[:-1] for t in split(lp_tol)]
    conds["log_probs"] = [t[:-1] for t in split(lp_cond)]
    if case.calculate_entropy or case.use_fused_kernels:  # (large vocabularies: only what is asked)
        ent = -(probs * lsm).sum(-1)
        ent_cond = (probs * (lsm + ent.unsqueeze(-1)).abs() * absz).sum(-1)
        result.entropy, tol["entropy"], conds["entropy"] = split(ent), split(_bound(ent_cond, ent, vocab)), \
            split(ent_cond)
    if case.calculate_sum_pi_squared:
        spq = (probs * probs).sum(-1)
        spq_cond = (2 * probs * (probs - spq.unsqueeze(-1)).abs() * absz).sum(-1)
        result.sum_pi_squared, tol["sum_pi_squared"], conds["sum_pi_squared"] = \
            split(spq), split(_bound(spq_cond, spq, vocab)), split(spq_cond)
    if case.calculate_entropy or case.use_fused_kernels or case.calculate_sum_pi_squared:
        for dtype in _cancellation_dtypes(case):
            bounds = cancellation_bounds(z, probs, spq if case.calculate_sum_pi_squared else None, dtype)
            result.bounds[f"{dtype}_cancellation"] = {key: split(bound) for key, bound in bounds.items()}
    if case.distillation_use_topk:
        terms = topk_terms(z32, tokens.teacher_ids, tokens.teacher_logprobs, log_prob_min_clamp(case))
        cond = (absz.max(-1).values + 1.0) * (1 + case.topk)
        for key in case.distillation_keys:
            result.distillation[key] = split(terms[key])
            tol[key] = split(_bound(cond, terms[key], vocab))
            conds[key] = split(cond.expand_as(terms[key]))
        for dtype in _cancellation_dtypes(case)[1:]:
            slack = topk_tie_slack(z, tokens.teacher_ids, tokens.teacher_logprobs, log_prob_min_clamp(case), dtype)
            result.ties[dtype] = {key: split(slack[key]) for key in OVERLAP_KEYS if key in case.distillation_keys}
    return result


def _media_of(tokens) -> dict:
    """The batch's media features and grids of the case's draws (``{}`` for a text-only case)."""
    media = getattr(tokens, "media_inputs", None)
    return media() if media is not None else {}


def _sample_media(micro_batch: TensorDict, i: int) -> dict:
    """Sample ``i``'s own media dict of a micro-batch's ``multi_modal_inputs`` (``{}`` where it has none)."""
    if "multi_modal_inputs" not in micro_batch.keys():
        return {}
    item = micro_batch.get("multi_modal_inputs").tolist()[i]
    return {key: value.cpu() for key, value in (item or {}).items() if value is not None}


def expected_loop(case: EngineCase, micro_batch: TensorDict, model: ToyCausalLM) -> Expected:
    """:func:`expected` as a plain loop over the sequences of a materialized micro-batch: the reference the
    vectorised oracle is tested against (slow; not used by the invariants)."""
    ids = micro_batch["input_ids"].unbind()
    positions = micro_batch["position_ids"].unbind()
    temps = case.temperatures()
    result = Expected(distillation={key: [] for key in case.distillation_keys})
    tol, conds = result.tolerance, result.condition
    for key in ("log_probs", "entropy", "sum_pi_squared", "values", *case.distillation_keys):
        tol[key] = []
        conds[key] = []
    cancel = {dtype: {"entropy": [], "sum_pi_squared": []} for dtype in _cancellation_dtypes(case)}
    teacher = None
    if case.distillation_use_topk:
        teacher = (micro_batch["teacher_ids"].unbind(), micro_batch["teacher_logprobs"].unbind())
    for i in range(case.batch_size):
        seq_ids, seq_pos = ids[i].cpu(), positions[i].cpu()
        pos = seq_pos.unsqueeze(-2) if seq_pos.dim() == 2 else seq_pos.unsqueeze(0)  # (C,1,n) or (1,n)
        logits = model.logits(seq_ids.unsqueeze(0), pos, **_sample_media(micro_batch, i)).squeeze(0)
        if case.head == "value":
            values = logits[:, 0].double()
            result.values.append(values)
            tol["values"].append(_bound(values.abs(), values, 1))
            conds["values"].append(values.abs())
            continue
        z32 = scaled_logits(logits, temps[i])
        z, vocab, lsm, probs, absz, mean_abs = _softmax_terms(z32)
        labels = seq_ids[1:]
        lp = lsm[:-1].gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        result.log_probs.append(lp)
        conds["log_probs"].append(absz[:-1].gather(-1, labels.unsqueeze(-1)).squeeze(-1) + mean_abs[:-1])
        tol["log_probs"].append(_bound(conds["log_probs"][-1], lp, vocab))
        if case.calculate_entropy or case.use_fused_kernels:  # (large vocabularies: only what is asked)
            ent = -(probs * lsm).sum(-1)
            result.entropy.append(ent)
            conds["entropy"].append((probs * (lsm + ent.unsqueeze(-1)).abs() * absz).sum(-1))
            tol["entropy"].append(_bound(conds["entropy"][-1], ent, vocab))
        if case.calculate_sum_pi_squared:
            spq = (probs * probs).sum(-1)
            result.sum_pi_squared.append(spq)
            conds["sum_pi_squared"].append((2 * probs * (probs - spq.unsqueeze(-1)).abs() * absz).sum(-1))
            tol["sum_pi_squared"].append(_bound(conds["sum_pi_squared"][-1], spq, vocab))
        if case.calculate_entropy or case.use_fused_kernels or case.calculate_sum_pi_squared:
            for dtype, per_key in cancel.items():
                bounds = cancellation_bounds(z, probs, spq if case.calculate_sum_pi_squared else None, dtype)
                for key, bound in bounds.items():
                    per_key[key].append(bound)
        if teacher is not None:
            terms = topk_terms(z32, teacher[0][i].cpu(), teacher[1][i].cpu(), log_prob_min_clamp(case))
            cond = (absz.max(-1).values + 1.0) * (1 + case.topk)
            for key in case.distillation_keys:
                result.distillation[key].append(terms[key])
                tol[key].append(_bound(cond, terms[key], vocab))
                conds[key].append(cond.expand_as(terms[key]))
            for dtype in _cancellation_dtypes(case)[1:]:
                slack = topk_tie_slack(z, teacher[0][i].cpu(), teacher[1][i].cpu(), log_prob_min_clamp(case), dtype)
                for key in OVERLAP_KEYS:
                    if key in case.distillation_keys:
                        result.ties.setdefault(dtype, {}).setdefault(key, []).append(slack[key])
    for dtype, per_key in cancel.items():
        if any(per_key.values()):
            result.bounds[f"{dtype}_cancellation"] = {key: bounds for key, bounds in per_key.items() if bounds}
    return result


def _cancellation_dtypes(case: "EngineCase") -> tuple[str, ...]:
    """The dtypes a cancellation bound is derived for: float32 (the contract's), and the logits' own dtype where
    lower (an engine computing in it)."""
    low = getattr(case, "logits_dtype", "float32")
    return ("float32",) if low == "float32" else ("float32", low)
