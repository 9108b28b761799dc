"""Invariants of the autograd context (``EngineCase.context``).

Every invariant runs in all three contexts a trainer calls the preparation in (the strategies draw it); this
module holds what only one context can show: in the policy update (grad enabled, the logits require grad) the
outputs a loss reads must carry the gradient back to the logits.
"""

from __future__ import annotations

from ..protocol.profile import profile_of
from ..truth.outputs_checks import outputs_carry_grad as carry_grad
from .core import Ctx, EveryFailure, fail, invariant
from .reproduction import Plan


@invariant("INV-GRAD-001", "with grad enabled and logits requiring grad, log_probs, entropy, sum_pi_squared and "
           "values require grad (the loss backpropagates through them); an output the engine's profile declares a "
           "metric only (EngineProfile.metrics: entropy under no_grad) is detached instead", contract=9,
           facts=("key",),
           protects="the policy loss, its entropy bonus and the critic loss get gradients in the policy update, and "
                    "no loss backpropagates through what the engine computes as a metric only",
           adjust=lambda c: c.with_(context="grad"), repro=Plan(("grad", "keys", "values")))
def outputs_carry_grad(ctx: Ctx) -> None:
    if not ctx.run.model_outputs or not any(getattr(v, "requires_grad", False)
                                            for v in vars(ctx.run.model_outputs[0]).values()):
        fail("the harness handed the model's outputs without grad in the grad context")
    facts = EveryFailure()
    carry_grad(ctx.run.rank_outputs, profile_of(ctx.engine).metrics, each=facts.each)
    facts.raise_any()
