"""Routed experts (docs/contract.md, "Routed experts"; contract clause 16): an MoE rollout's captured routes, where the
engine collates them for router replay (a switch of its configuration named ``routed_experts``), are handed on at
each sample's own tokens.

The strategy pins the switch on (``pin_routes``), so every example carries routes; the micro-batch holds each sample's
captured routes (:mod:`spec.cases.materialize`, the rule :mod:`spec.truth.routes`).
"""

from __future__ import annotations

from ..cases.materialize import draws
from ..protocol.profile import routes_dtype
from ..truth.routes import routes_handed
from .core import Ctx, invariant
from .reproduction import Plan


@invariant("INV-ROUTE-001", "the rollout's routed experts are handed on at each sample's own tokens, in sample order, "
           "the tokens without a captured route routed to distinct experts", contract=16,
           protects="router replay routes every token through the experts the rollout routed it to (a route moved to "
           "another token or sample silently changes the replayed forward)",
           needs=("routes",), strategy_kwargs={"pin_routes": True}, repro=Plan(("routes_handed",)))
def routes_handed_on(ctx: Ctx) -> None:
    dtype = routes_dtype(ctx.case)
    if dtype is None:
        ctx.not_exercised("the case carries no routed experts (its engine's routed_experts switch drawn off)")
        return
    ids = draws(ctx.case).ids.split(list(ctx.case.seq_lens))
    for view in ctx.inputs_run.views:
        routes_handed(view.routes, list(ids), dtype)
