"""Training-step cases: structure only (the mini-batch's lengths, the DP size, the cut, the loss and its mode, a seed).

A :class:`StepCase` is one mini-batch on every data-parallel rank (rank r holds the r-th contiguous block of
``B / dp`` samples, as a trainer dispatches it), the cut a framework's step makes of each rank's share (a sample count
or a token budget), the loss, its aggregation mode and horizon, and the preparation's mode (packed or padded).
Tensors come from the seed (:func:`materialize_step`): the preparation's keys of :func:`spec.cases.materialize.
materialize`, and the step keys (:data:`spec.protocol.step.STEP_KEYS`) nested over each response (and, where the aggregation reads prompt groups, each sample's prompt id): the loss mask
(the drawn holes, the first response token of sample 0 always counted so that no mini-batch is empty), the old
policy's log-probs (the stand-in's own, moved by a seeded amount inside the clip range), advantages, old values
(the value head's own, moved inside the value clip range) and returns. Failures shrink towards
``StepCase(p=[1] r=[1] dp=1 count mbs=1 <first loss and mode> seed=0)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from ..protocol.step import PROMPT_KEY, Cut, CutPlan, Divisor, LossSetting, StepLayer
from ..truth.rules import response_index
from ..truth.step_model import StepModel
from ..truth.step_oracle import StepInputs
from .materialize import draws, jagged, materialize, select_rows
from .structure import EngineCase, SampleLengths

__all__ = ["StepCase", "step_cases", "materialize_step", "step_inputs", "select_rows", "SHIFT"]

#: the old log-probs and old values are the model's own moved by up to this much (inside every clip range drawn)
SHIFT = 0.1


@dataclass(frozen=True)
class StepCase(SampleLengths):
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    dp: int = 1
    cut: str = "count"
    micro_batch_size: int = 1
    max_token_len: int = 0
    loss: str = "policy"
    mode: str = "token-mean"
    horizon: int | None = None
    use_remove_padding: bool = True
    holes: float = 0.0
    vocab: int = 16
    #: the teacher's top-K (a distillation loss), 0: none
    topk: int = 0
    #: the sizes of the mini-batch's consecutive prompt groups (GRPO's responses to one prompt; they may straddle
    #: ranks), summing to the batch size; (): no prompt ids handed (an aggregation that reads none)
    prompt_groups: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        self._check_lengths()
        if self.batch_size % self.dp:
            raise ValueError(f"{self.batch_size} samples do not split over dp={self.dp} ranks")
        if self.prompt_groups and (sum(self.prompt_groups) != self.batch_size or min(self.prompt_groups) < 1):
            raise ValueError(f"prompt_groups {list(self.prompt_groups)}: positive sizes summing to the "
                             f"{self.batch_size} samples expected")
        Cut(self.cut)

    @property
    def prompt_ids(self) -> torch.Tensor | None:
        """Each sample's prompt group ``(B,)`` int64 (:data:`spec.protocol.step.PROMPT_KEY`), None without groups."""
        if not self.prompt_groups:
            return None
        return torch.repeat_interleave(torch.arange(len(self.prompt_groups)), torch.tensor(self.prompt_groups))

    @property
    def per_rank(self) -> int:
        return self.batch_size // self.dp

    def rank_rows(self, rank: int) -> list[int]:
        return list(range(rank * self.per_rank, (rank + 1) * self.per_rank))

    @property
    def plan(self) -> CutPlan:
        return CutPlan(self.dp, Cut(self.cut), self.micro_batch_size, self.max_token_len, self.batch_size)

    @property
    def setting(self) -> LossSetting:
        return LossSetting(self.loss, self.mode, self.horizon)

    def engine_case(self) -> EngineCase:
        """The mini-batch's samples as one engine case (temperature 1, no extras): what the preparation sees."""
        return EngineCase(self.prompt_lens, self.response_lens, vocab=self.vocab, temperature=1.0,
                          use_remove_padding=self.use_remove_padding, mask_hole_rate=self.holes, seed=self.seed,
                          eos_token_id=None, head="value" if self.loss == "value" else "lm",
                          distillation_keys=("distillation_losses",) if self.topk else (), topk=self.topk or 2)

    def with_(self, **changes: object) -> "StepCase":
        return replace(self, **changes)

    def __repr__(self) -> str:
        cut = f"mbs={self.micro_batch_size}" if self.cut == "count" else f"budget={self.max_token_len}"
        parts = [f"p={list(self.prompt_lens)}", f"r={list(self.response_lens)}", f"dp={self.dp}", self.cut, cut,
                 self.loss, self.mode]
        if self.horizon is not None:
            parts.append(f"horizon={self.horizon}")
        if not self.use_remove_padding:
            parts.append("padded")
        if self.holes:
            parts.append(f"holes={self.holes}")
        if self.vocab != 16:
            parts.append(f"V={self.vocab}")
        if self.topk:
            parts.append(f"topk={self.topk}")
        if self.prompt_groups:
            parts.append(f"prompts={list(self.prompt_groups)}")
        return "StepCase(" + " ".join(parts + [f"seed={self.seed}"]) + ")"


# -- strategies ---------------------------------------------------------------------------------------------------

@st.composite
def step_cases(draw, layer: StepLayer, modes: tuple[str, ...] = ("packed", "padded")) -> StepCase:
    """A :class:`StepCase` within what ``layer`` allows: its DP sizes and cuts (equal micro-batches where it asks
    them), every loss it offers and every aggregation mode of that loss, each horizon it may be given; the
    preparation's mode among ``modes`` (the engine's profile)."""
    dp = draw(st.sampled_from(layer.dp_sizes))
    cut = draw(st.sampled_from(layer.cuts))
    if cut is Cut.COUNT:
        mbs = draw(st.integers(1, 2))
        per_rank = mbs * draw(st.integers(1, 3))
    else:
        mbs, per_rank = 1, draw(st.integers(1, 4))
    batch = dp * per_rank
    prompts = tuple(draw(st.lists(st.integers(1, 4), min_size=batch, max_size=batch)))
    responses = tuple(draw(st.lists(st.integers(1, 6), min_size=batch, max_size=batch)))
    budget = 0
    if cut is Cut.TOKENS:  # between every rank's longest sample and its whole share
        seq = [p + r for p, r in zip(prompts, responses)]
        shares = [seq[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
        longest, widest = max(max(s) for s in shares), max(sum(s) for s in shares)
        budget = draw(st.integers(longest, max(longest, widest)))
    loss = draw(st.sampled_from(layer.losses))
    mode = draw(st.sampled_from(loss.modes))
    horizon = draw(st.sampled_from(loss.horizons)) if Divisor.HORIZON in mode.divisors else None
    packed = draw(st.sampled_from(tuple(m == "packed" for m in modes)))
    holes = draw(st.sampled_from((0.0, 0.3)))
    groups: tuple[int, ...] = ()
    if mode.reads_prompts:  # where each new prompt starts (shrinks to one group: the whole mini-batch's)
        starts = draw(st.lists(st.booleans(), min_size=batch - 1, max_size=batch - 1))
        cuts = [0, *(i + 1 for i, new in enumerate(starts) if new), batch]
        groups = tuple(b - a for a, b in zip(cuts, cuts[1:]))
    return StepCase(prompts, responses, dp=dp, cut=cut.value, micro_batch_size=mbs, max_token_len=budget,
                    loss=loss.name, mode=mode.name, horizon=horizon, use_remove_padding=packed, holes=holes,
                    topk=loss.topk, prompt_groups=groups, seed=draw(st.integers(0, 2 ** 16)))


# -- tensors ------------------------------------------------------------------------------------------------------

def _response_draws(case: StepCase) -> dict[str, torch.Tensor]:
    """Flat over every response token (sample-major): the loss mask, the scoring rows' features and labels, and the
    step keys, float64, from the case's seed and the stand-in model alone."""
    whole = case.engine_case()
    d = draws(whole)
    model = StepModel(case.vocab, seed=case.seed, out_dim=1 if case.loss == "value" else None)
    features = model.features(d.ids, d.position_ids(whole), whole.seq_lens)
    at = response_index(case.prompt_lens, case.response_lens)
    mask = d.loss_mask.clone()
    mask[0] = 1  # the first response token of sample 0 always counts: no mini-batch without a loss token
    z = features[at] @ model.weight.detach().double()
    labels = d.ids[at + 1]
    gen = torch.Generator().manual_seed(case.seed + 7)
    n = int(at.numel())
    shift = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * SHIFT
    if case.loss == "value":
        old = z[:, 0] + shift
    else:
        old = torch.log_softmax(z, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1) + shift
    teacher = {} if d.teacher_ids is None else {"teacher_ids": d.teacher_ids[at],
                                                "teacher_logprobs": d.teacher_logprobs[at].to(torch.float64)}
    return {**teacher, "features": features[at], "labels": labels, "mask": mask,
            "advantages": torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1,
            "old": old, "returns": torch.randn(n, generator=gen, dtype=torch.float64)}


def step_inputs(case: StepCase) -> StepInputs:
    """The oracle's view of the mini-batch (spec/truth/step_oracle.py), from the seed, never from what an engine was
    handed. The step keys are compared as the engine receives them (float32)."""
    r = _response_draws(case)
    sample = torch.repeat_interleave(torch.arange(case.batch_size), torch.tensor(case.response_lens))
    as32 = lambda t: t.to(torch.float32).to(torch.float64)  # noqa: E731 - what the float32 keys hold
    return StepInputs(features=r["features"], labels=r["labels"], sample=sample, mask=r["mask"],
                      advantages=as32(r["advantages"]), old_log_probs=as32(r["old"]), returns=as32(r["returns"]),
                      batch_size=case.batch_size, response_width=max(case.response_lens),
                      teacher_ids=r.get("teacher_ids"), teacher_logprobs=r.get("teacher_logprobs"),
                      prompt=case.prompt_ids)


def materialize_step(case: StepCase) -> TensorDict:
    """The whole mini-batch (every rank's samples, in order): the preparation's keys and flags, and the step keys
    nested over each response (float32, the masks int64)."""
    td = materialize(case.engine_case())
    r = _response_draws(case)
    lens = case.response_lens
    td.set("loss_mask", jagged(r["mask"], lens))
    td.set("response_mask", jagged(r["mask"].clone(), lens))
    keys = {"old_log_probs": r["old"], "advantages": r["advantages"], "values": r["old"], "returns": r["returns"]}
    for key, values in keys.items():
        td.set(key, jagged(values.to(torch.float32), lens))
    if case.prompt_groups:
        td.set(PROMPT_KEY, case.prompt_ids)
    return td
