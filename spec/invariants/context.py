"""Invariants of the autograd context (``EngineCase.context``).

Every invariant runs in all three contexts a trainer calls the preparation in (the strategies draw it); this
module holds what only one context can show: in the policy update (grad enabled, the logits require grad) the
outputs a loss reads must carry the gradient back to the logits.
"""

from __future__ import annotations

from ..protocol.profile import profile_of
from .core import Ctx, EveryFailure, fail, invariant

#: outputs a policy or critic loss differentiates (the distillation terms are the processor's, overlap_count a
#: count; fused kernels' outputs are the model's own)
DIFFERENTIABLE = ("log_probs", "entropy", "sum_pi_squared", "values")


@invariant("INV-GRAD-001", "with grad enabled and logits requiring grad, log_probs, entropy, sum_pi_squared and "
           "values require grad (the loss backpropagates through them); an output the engine's profile declares a "
           "metric only (EngineProfile.metrics: entropy under no_grad) is detached instead", contract=9,
           facts=("key",),
           protects="the policy loss, its entropy bonus and the critic loss get gradients in the policy update, and "
                    "no loss backpropagates through what the engine computes as a metric only",
           adjust=lambda c: c.with_(context="grad"))
def outputs_carry_grad(ctx: Ctx) -> None:
    if not ctx.run.model_outputs or not any(getattr(v, "requires_grad", False)
                                            for v in vars(ctx.run.model_outputs[0]).values()):
        fail("the harness handed the model's outputs without grad in the grad context")
    metrics = profile_of(ctx.engine).metrics
    facts = EveryFailure()
    for r, outputs in enumerate(ctx.run.rank_outputs):
        for key in DIFFERENTIABLE:
            if key not in outputs:
                continue
            with facts.each():
                if key in metrics and outputs[key].requires_grad:
                    fail(f"rank {r}: output {key!r} requires grad although the engine's profile declares it a metric "
                         "only (EngineProfile.metrics): a loss reading it would backpropagate through it", key=key)
                if key not in metrics and not outputs[key].requires_grad:
                    fail(f"rank {r}: output {key!r} does not require grad although the model's logits do "
                         f"(detached from the autograd graph: the loss gets no gradient through it; an output "
                         f"computed as a metric only is declared so: EngineProfile(metrics={{{key!r}}}))", key=key)
    facts.raise_any()
