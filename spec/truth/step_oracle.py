"""The float64 oracle of a training step: the uncut mini-batch's loss and its gradient, each with its bound.

A step's loss is a function of the per-token losses of every response token of the mini-batch (on every rank) and of
the aggregation mode (:class:`spec.protocol.step.Aggregation`): ``L = sum_i sum_t w_i m_it l_it / D`` with ``w_i``
1, one over sequence i's valid tokens, or one over its prompt group's valid tokens (over the mini-batch), and ``D``
the product of the mode's divisors (valid tokens, samples, a horizon; or the samples with a loss token, or the
prompt groups) counted over the whole mini-batch; for a mode a library documents as local, each micro-batch's own ``D`` and
the micro-batches' losses averaged (what gradient accumulation over ``k`` micro-batches per rank, ``1/k`` each, and
the DDP/FSDP average over the ranks give). The per-token loss ``l`` is one of :class:`spec.protocol.step.PerToken`,
evaluated on the head's float64 logits ``z = features @ weight`` of each response token's scoring row (the token
before it: :func:`spec.truth.rules.response_index`). Everything is float64 and the gradient is autograd's, with
respect to the stand-in's head weight (spec/truth/step_model.py): the gradient a correct step accumulates.

The bound: the engine computes in float32 (eps = 2^-23) from logits of magnitude up to ``|z|``; each token's share of
the loss and of the gradient may carry a relative error of a few eps times ``1 + max |z|`` (the log-softmax's
condition), so the allowed error is ``64 * eps * (1 + max|z|)`` times the same aggregation of the shares' absolute
values (``sum |w m l| / D`` for the loss, ``|features|^T |dL/dz|`` per gradient element). A normalisation off by
any factor (a micro-batch count, a rank count, a padded width) is far outside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch

from ..protocol.step import Aggregation, Divisor, PerToken, Scope, Weighting

__all__ = ["StepInputs", "StepTruth", "per_token_loss", "aggregate", "step_truth", "BOUND_FACTOR"]

EPS32 = 2.0 ** -23
#: the float32 error budget of a token's share, in eps times (1 + max |z|)
BOUND_FACTOR = 64.0


@dataclass(frozen=True)
class StepInputs:
    """Every response token of the mini-batch (all ranks, sample-major), float64 where a value: the head inputs of its
    scoring row ``features`` ``(n, H)``, its ``label`` (the response token), its ``sample``, its loss ``mask`` (0/1),
    the step keys ``advantages``, ``old_log_probs``, ``returns``; ``batch_size`` samples, ``response_width`` the
    longest response."""

    features: torch.Tensor
    labels: torch.Tensor
    sample: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    returns: torch.Tensor
    batch_size: int
    response_width: int
    #: the teacher's top-K ids and log-probs at each scoring row ``(n, K)`` (distillation only)
    teacher_ids: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    #: each sample's prompt group ``(batch_size,)`` int64 (None: every sample its own prompt)
    prompt: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTruth:
    """The uncut mini-batch's loss and head gradient (float64) and the errors a float32 step may make."""

    loss: float
    loss_bound: float
    grad: torch.Tensor
    grad_bound: torch.Tensor


def per_token_loss(kind: PerToken, z: torch.Tensor, x: StepInputs, parameters: Mapping[str, float] | None = None
                   ) -> torch.Tensor:
    """``(n,)`` per-token losses from the head's logits ``z`` ``(n, out)``; ``parameters``: the form's
    (:data:`spec.protocol.step.PER_TOKEN_PARAMETERS`)."""
    kind, p = PerToken(kind), dict(parameters or {})
    if kind is PerToken.VALUE:
        return 0.5 * (z[:, 0] - x.returns) ** 2
    if kind is PerToken.TOPK_FORWARD_KL:
        student = torch.log_softmax(z, dim=-1).gather(-1, x.teacher_ids)
        teacher = x.teacher_logprobs
        return (teacher.exp() * (teacher - student)).sum(-1).clamp_min(0.0)
    log_probs = torch.log_softmax(z, dim=-1).gather(-1, x.labels.unsqueeze(-1)).squeeze(-1)
    if kind is PerToken.NLL:
        return -log_probs
    log_ratio, mask = log_probs - x.old_log_probs, x.mask.to(z.dtype)
    if kind is PerToken.POLICY_GRADIENT:
        return -x.advantages * log_probs
    if kind is PerToken.QUADRATIC_PENALTY:
        return -(x.advantages * log_probs - 0.5 * p["beta"] * log_ratio ** 2)
    if kind in (PerToken.SEQUENCE_RATIO, PerToken.SEQUENCE_RATIO_TOKEN):
        total = torch.zeros(x.batch_size, dtype=z.dtype).index_add(0, x.sample, mask * log_ratio)
        count = torch.zeros(x.batch_size, dtype=z.dtype).index_add_(0, x.sample, mask).clamp(min=1.0)
        sequence = (total / count)[x.sample]
        if kind is PerToken.SEQUENCE_RATIO_TOKEN:
            sequence = log_probs - log_probs.detach() + sequence.detach()
        return -x.advantages * torch.exp(sequence)
    if kind is PerToken.CLIPPED_WEIGHT:
        return -torch.exp(log_ratio).clamp(p["low"], p["high"]).detach() * x.advantages * log_probs
    if kind is PerToken.SOFT_GATE:
        tau = torch.where(x.advantages > 0, p["tau_pos"], p["tau_neg"]).to(z.dtype)
        return -torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * 4.0 / tau * x.advantages
    if kind is PerToken.GAMMA_WEIGHT:
        total = torch.zeros(x.batch_size, dtype=z.dtype).index_add(0, x.sample, mask * log_ratio.clamp(-20.0, 20.0))
        log_w = total.clamp(math.log(1e-8), 20.0)[x.sample].detach()
        positive = x.advantages >= 0
        k = torch.where(positive, p["k_pos"], p["k_neg"]).to(z.dtype)
        lam = torch.where(positive, p["lambda_pos"], p["lambda_neg"]).to(z.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return -phi * x.advantages * log_probs
    return -x.advantages * torch.exp(log_ratio)


def aggregate(losses: torch.Tensor, x: StepInputs, mode: Aggregation, horizon: int | None = None,
              groups: list[list[int]] | None = None) -> torch.Tensor:
    """The mode's scalar from per-token ``losses`` (the mini-batch's, or for a micro-batch scope the mean over
    ``groups``, the samples of each micro-batch on every rank). ``horizon``: the mode's constant (None: the
    mini-batch's longest response)."""
    mask = x.mask.to(losses.dtype)
    valid = torch.zeros(x.batch_size, dtype=losses.dtype).index_add_(0, x.sample, mask)
    prompt = x.prompt if x.prompt is not None else torch.arange(x.batch_size)
    if mode.weighting is Weighting.TOKEN:
        weight = torch.ones_like(losses)
    else:  # a token mean per sequence, or per prompt group (its loss tokens over the mini-batch)
        per = valid if mode.weighting is Weighting.SEQUENCE_MEAN else \
            torch.zeros(x.batch_size, dtype=losses.dtype).index_add_(0, prompt, valid)[prompt]
        weight = torch.where(per > 0, 1.0 / per.clamp(min=1.0), torch.zeros_like(per))[x.sample]
    share = torch.zeros(x.batch_size, dtype=losses.dtype).index_add_(0, x.sample, weight * mask * losses)
    width = float(horizon if horizon is not None else x.response_width)

    def divided(samples: torch.Tensor) -> torch.Tensor:
        divisor = torch.ones((), dtype=losses.dtype)
        for factor in mode.divisors:
            if factor is Divisor.TOKENS:
                divisor = divisor * valid[samples].sum().clamp(min=1.0)
            elif factor is Divisor.SEQUENCES:
                divisor = divisor * samples.numel()
            elif factor is Divisor.VALID_SEQUENCES:
                divisor = divisor * (valid[samples] > 0).sum().clamp(min=1)
            elif factor is Divisor.PROMPTS:
                divisor = divisor * prompt[samples].unique().numel()
            else:
                divisor = divisor * width
        return share[samples].sum() / divisor

    if mode.scope is Scope.GLOBAL:
        return divided(torch.arange(x.batch_size))
    if not groups:
        raise ValueError(f"aggregation {mode.name!r} is local to micro-batches: the micro-batches' samples are needed")
    return torch.stack([divided(torch.tensor(g, dtype=torch.int64)) for g in groups]).mean()


def step_truth(x: StepInputs, weight: torch.Tensor, kind: PerToken, mode: Aggregation, horizon: int | None = None,
               groups: list[list[int]] | None = None, parameters: Mapping[str, float] | None = None) -> StepTruth:
    """The loss and its gradient with respect to the head ``weight`` ``(H, out)``, in float64, and their bounds."""
    w = weight.detach().to(torch.float64)
    z = (x.features @ w).requires_grad_(True)
    losses = per_token_loss(kind, z, x, parameters)
    loss = aggregate(losses, x, mode, horizon, groups)
    (dz,) = torch.autograd.grad(loss, z)
    scale = BOUND_FACTOR * EPS32 * (1.0 + float(z.detach().abs().max()) if z.numel() else 1.0)
    magnitude = aggregate(losses.detach().abs(), x, mode, horizon, groups)
    return StepTruth(loss=float(loss.detach()), loss_bound=scale * float(magnitude) + 1e-12, grad=x.features.T @ dz,
                     grad_bound=scale * (x.features.abs().T @ dz.abs()) + 1e-12)
