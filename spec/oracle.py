"""Expectations computed per sequence, as plainly as possible (loops are fine here).

The oracle runs the model stand-in on each sequence alone (no padding, no packing),
in float64 from there on, and reads every quantity straight off the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from .cases import EngineCase
from .toy_model import ToyCausalLM

__all__ = ["Expected", "expected", "topk_terms", "TopKProcessor"]


def topk_terms(student_logits: torch.Tensor, teacher_ids: torch.Tensor,
               teacher_logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token top-K distillation terms from ``(n, V)`` logits and ``(n, K)`` teacher top-K."""
    student = torch.log_softmax(student_logits, dim=-1)
    at_teacher = student.gather(-1, teacher_ids)
    teacher_p = teacher_logprobs.exp()
    k = teacher_ids.shape[-1]
    student_top = student.topk(min(k, student.shape[-1]), dim=-1).indices
    overlap = (teacher_ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(-1)
    return {
        "distillation_losses": (teacher_p * (teacher_logprobs - at_teacher)).sum(-1),
        "student_mass": at_teacher.exp().sum(-1),
        "teacher_mass": teacher_p.sum(-1),
        "overlap_count": overlap.to(student.dtype).sum(-1),
        "overlap_token_advantage": (at_teacher - teacher_logprobs).mean(-1),
    }


class TopKProcessor:
    """A ``logits_processor_func`` returning ``keys`` of :func:`topk_terms`, ``(1, total_nnz)`` each.

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
        terms = topk_terms(student_logits[0].float(), teacher_ids, teacher_lp.float())
        return {key: terms[key].unsqueeze(0) for key in self.keys}


@dataclass
class Expected:
    """Per-sequence expectations (lists indexed by sample), float64."""

    log_probs: list[torch.Tensor] = field(default_factory=list)  # (n_i - 1,): the last token has no label
    entropy: list[torch.Tensor] = field(default_factory=list)  # (n_i,)
    sum_pi_squared: list[torch.Tensor] = field(default_factory=list)
    distillation: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    values: list[torch.Tensor] = field(default_factory=list)

    def response_log_probs(self, case: EngineCase) -> torch.Tensor:
        """``(B, response_width)``: log-prob of each response token, zero past ``r_i``."""
        out = torch.zeros(case.batch_size, case.response_width, dtype=torch.float64)
        for i, (p, r) in enumerate(zip(case.prompt_lens, case.response_lens)):
            for j in range(r):
                out[i, j] = self.log_probs[i][p - 1 + j]
        return out


def expected(case: EngineCase, micro_batch: TensorDict, model: ToyCausalLM) -> Expected:
    """Everything the contract says the engine returns for ``case``, sequence by sequence."""
    ids = micro_batch["input_ids"].unbind()
    positions = micro_batch["position_ids"].unbind()
    temps = case.temperatures()
    result = Expected(distillation={key: [] for key in case.distillation_keys})
    teacher = None
    if case.distillation_use_topk:
        teacher = (micro_batch["teacher_ids"].unbind(), micro_batch["teacher_logprobs"].unbind())
    for i in range(case.batch_size):
        seq_ids, seq_pos = ids[i], positions[i]
        pos = seq_pos.unsqueeze(-2) if seq_pos.dim() == 2 else seq_pos.unsqueeze(0)  # (C,1,n) or (1,n)
        logits = model.logits(seq_ids.unsqueeze(0), pos).squeeze(0).double()
        if case.head == "value":
            result.values.append(logits[:, 0])
            continue
        scaled = logits / max(temps[i], 1e-8)
        lsm = torch.log_softmax(scaled, dim=-1)
        probs = lsm.exp()
        result.log_probs.append(torch.stack([lsm[k, seq_ids[k + 1]] for k in range(len(seq_ids) - 1)])
                                if len(seq_ids) > 1 else lsm.new_zeros(0))
        result.entropy.append(-(probs * lsm).sum(-1))
        result.sum_pi_squared.append((probs * probs).sum(-1))
        if teacher is not None:
            terms = topk_terms(scaled, teacher[0][i], teacher[1][i].double())
            for key in case.distillation_keys:
                result.distillation[key].append(terms[key])
    return result
