"""The stand-in model of the training step: :class:`~spec.truth.toy_model.ToyCausalLM` with a trainable head.

The step's gradient must be a real one, so the head's weight ``(H, out)`` is a float32 parameter (the toy model's own
projection, copied): ``logits = (features64 @ weight.double()).float()``. The features (ids, positions and the
attention the mask allows, in float64) carry no parameter; the head does. The logits are therefore exactly the toy
model's (``weight.double()`` is its float64 projection), so the per-sequence oracle of the preparation
(:func:`spec.truth.oracle.expected`) holds for the step's outputs too, and the gradient of any loss is
``features^T @ dloss/dlogits``: the float64 oracle (spec/truth/step_oracle.py) takes it from the same features.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .toy_model import ToyCausalLM

__all__ = ["StepModel"]


class StepModel:
    """A causal LM (``out_dim=None``) or a value model (``out_dim=1``) whose head ``weight`` trains. ``hidden``: it
    hands an engine of the fused-head protocol the head's input and weight (``hidden_states`` float32 and
    ``lm_head_weight``, the trainable weight transposed) instead of the logits: the same product, in float32."""

    def __init__(self, vocab: int, *, seed: int, out_dim: int | None = None, hidden: bool = False) -> None:
        self.toy, self.hidden = ToyCausalLM(vocab, seed=seed, out_dim=out_dim), hidden
        #: the trainable head, (H, out) float32: the toy model's projection, a fresh copy per model
        self.weight = torch.nn.Parameter(self.toy.proj.detach().clone().to(torch.float32))

    def zero_grad(self) -> None:
        self.weight.grad = None

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, **_ignored: object) -> SimpleNamespace:
        features = self.toy._features(input_ids, position_ids, attention_mask)
        if self.hidden:  # the fused-head protocol's view of the same head: its input and its weight (V, H), float32
            return SimpleNamespace(hidden_states=features.float(), lm_head_weight=self.weight.T)
        return SimpleNamespace(logits=(features @ self.weight.double()).float())

    def features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lens) -> torch.Tensor:
        """``(n, H)`` float64 head inputs of each sequence run alone (the oracle's)."""
        return self.toy.sequence_features(input_ids, position_ids, lens)
