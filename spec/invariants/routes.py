"""Routed experts (docs/contract.md, "Routed experts"; contract clause 16): an MoE rollout's captured routes, where the
engine collates them for router replay (a switch of its configuration named ``routed_experts``), are handed on at
each sample's own tokens (INV-ROUTE-001); where the engine records the routes instead (R2's ``compute_log_prob``: the
switch's value ``record``), it returns each sample's own (INV-ROUTE-002).

The strategy pins the switch on (``pin_routes``), so every example carries routes (or records them); the
micro-batch holds each sample's captured routes (:mod:`spec.cases.materialize`, the rule :mod:`spec.truth.routes`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cases.materialize import draws
from ..protocol.profile import ROUTES_RECORDED, routes_dtype, routes_recorded
from ..truth.routes import routes_handed, routes_record
from .core import Ctx, invariant
from .reproduction import Plan


@invariant("INV-ROUTE-001", "the rollout's routed experts are handed on at each sample's own tokens, in sample order, "
           "at every token a counted log-prob reads (those before the sample's last counted response token), the "
           "tokens without the rollout's route routed to distinct experts", contract=16,
           protects="router replay routes every token through the experts the rollout routed it to (a route moved to "
           "another token or sample silently changes the replayed forward)",
           needs=("routes",), strategy_kwargs={"pin_routes": True}, repro=Plan(("routes_handed",)))
def routes_handed_on(ctx: Ctx) -> None:
    dtype = routes_dtype(ctx.case)
    if dtype is None:
        ctx.not_exercised("the case carries no routed experts (its engine's routed_experts switch drawn off)")
        return
    d = draws(ctx.case)
    ids = d.ids.split(list(ctx.case.seq_lens))
    for view in ctx.inputs_run.views:
        routes_handed(view.routes, list(ids), dtype, read_rows(d.loss_mask, ctx.case))


@invariant("INV-ROUTE-002", "router replay's R2 record: the routes an engine records and returns (routed_experts, "
           "per sample) are those its MoE routers took at each of the sample's own tokens, every token's, in token "
           "order, none of another sample's or of the padding's", contract=16,
           protects="R2 replays in the policy update the routes recorded in compute_log_prob: a route recorded one "
                    "token off, or another sample's, or the padding's, replays a token through experts it was never "
                    "routed to (the update's log-probs silently drift from the old policy's)",
           needs=("routes_record",), strategy_kwargs={"pin_routes": ROUTES_RECORDED},
           repro=Plan(("routes_recorded",)))
def routes_recorded_on(ctx: Ctx) -> None:
    if not routes_recorded(ctx.case):
        ctx.not_exercised("the case records no routes (its engine's routed_experts switch not drawn to record)")
        return
    ids = list(draws(ctx.case).ids.split(list(ctx.case.seq_lens)))
    for r, routes in enumerate(ctx.run.rank_routes):
        try:
            routes_record(routes, ids)
        except AssertionError as error:
            raise AssertionError(f"rank {r}: {error}" if len(ctx.run.rank_routes) > 1 else str(error)) from None


def read_rows(loss_mask: torch.Tensor, case: Any) -> list[int]:
    """Per sample, the rows a counted log-prob reads: those before its last counted response token (its prompt and
    response up to there; none for a sample with no counted token)."""
    rows = []
    for p, mask in zip(case.prompt_lens, loss_mask.split(list(case.response_lens))):
        counted = mask.nonzero().flatten()
        rows.append(p + int(counted[-1]) if counted.numel() else 0)
    return rows
