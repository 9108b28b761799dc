"""Router replay's routed experts (docs/contract.md, "Routed experts"): the rule written once.

A mixture-of-experts rollout (vLLM's or SGLang's with routed-expert capture: R3) records, for each token it ran
through the model, the top-k experts each MoE layer routed it to: ``(captured, layers, top_k)`` per trajectory. The
last token a rollout samples is never run through the model, so ``captured = n - 1`` of a sequence's ``n`` tokens
(one for a one-token sequence). A trainer replaying the routes hands them on per token, the trajectory's captured
rows at its first tokens, in sample order: a route that lands on another token, or another sample's, routes that
token through other experts, silently. The tokens without a captured route get routes of their own whose top-k
experts are distinct in every layer (a duplicate would collapse an expert slot in the dispatch), which the
contract asks of nothing else.

* :func:`rollout_routes`: the routes the suite's stand-in rollout recorded for a sequence's ids (a fixed function of
  each token's id, its place and the layer, so a route moved to another token or sample differs);
* :func:`routes_handed`: the check that the routes handed on per sample are those (AssertionError naming the sample
  and token);
* :func:`places`: each packed token's place in its own sequence, by the row's boundaries (what the stand-in routers
  route by);
* :func:`routes_record`: the check of router replay's R2 record, the routes an engine returns per sample: those the
  stand-in MoE model's routers took at the sample's own tokens (:func:`model_routes`, in :data:`RECORDED_DTYPE`'s
  experts);
* :func:`routes_of`, :func:`captured_rows`, :func:`without_last_routes`: a micro-batch's routes per sample, the
  captured rows of one (a library that takes only those: SkyRL's), and a copy of the micro-batch whose routes miss
  the last sample's (routes of another batch: the refusal ``routes_misaligned``).

Imports nothing from ``spec`` (the truth layer).
"""

from __future__ import annotations

import torch

__all__ = ["ROUTES_KEY", "ROUTED_LAYERS", "ROUTED_TOPK", "ROUTE_DTYPES", "captured", "rollout_routes", "places", "model_routes",
           "routes_handed", "RECORDED_DTYPE", "routes_record",
           "routes_of", "captured_rows", "without_last_routes"]

#: the micro-batch's key for each sample's routes, nested ``(B, n_i, layers, top_k)`` (verl's name and layout): its
#: captured rows, then an all-zero row for each token without a captured route (a captured row never is: its top-k
#: are distinct)
ROUTES_KEY = "routed_experts"
#: the MoE layers and top-k of the stand-in rollout's routes
ROUTED_LAYERS = 2
ROUTED_TOPK = 2
#: the dtypes a rollout hands routes in, with the experts each holds: uint8 (up to 256), int16, int32
ROUTE_DTYPES = {"uint8": (torch.uint8, 8), "int16": (torch.int16, 300), "int32": (torch.int32, 300)}


def captured(n: int) -> int:
    """The route rows a rollout captured of an ``n``-token sequence (its last sampled token never ran: ``n - 1``)."""
    return max(1, n - 1)


def rollout_routes(ids: torch.Tensor, dtype: str, place: torch.Tensor | None = None) -> torch.Tensor:
    """``(n, ROUTED_LAYERS, ROUTED_TOPK)`` routes of the tokens ``ids`` ``(n,)`` at their places in their sequence
    (``place``; default ``0..n-1``, one sequence) in ``dtype`` (a key of :data:`ROUTE_DTYPES`): each token's top-k
    are distinct experts, a function of its id, its place and the layer. A rollout captured the first
    :func:`captured` rows of a sequence's."""
    torch_dtype, experts = ROUTE_DTYPES[dtype]
    ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1, 1, 1).cpu()
    place = (torch.arange(ids.shape[0]) if place is None else place.cpu()).reshape(-1, 1, 1)
    layer = torch.arange(ROUTED_LAYERS).reshape(1, -1, 1)
    slot = torch.arange(ROUTED_TOPK).reshape(1, 1, -1)
    return ((ids * 7 + place * 3 + layer * 5) % experts + slot).remainder(experts).to(torch_dtype)


def places(bounds: torch.Tensor, n: int) -> torch.Tensor:
    """Each of a packed row's ``n`` tokens' place in its own sequence (what :func:`model_routes` reads): its index
    less its sequence's start by the boundaries ``bounds`` (``(B + 1,)``, from 0); rows past the last boundary (a
    tail padding) count from it."""
    index = torch.arange(n)
    bounds = bounds.reshape(-1).to(torch.int64).cpu()
    start = bounds[(torch.searchsorted(bounds, index, right=True) - 1).clamp(min=0, max=bounds.numel() - 1)]
    return index - start


def model_routes(ids: torch.Tensor, dtype: str, place: torch.Tensor | None = None) -> torch.Tensor:
    """``(n, ROUTED_LAYERS, ROUTED_TOPK)`` int64 routes the stand-in MoE model's routers pick on their own for the
    tokens ``ids`` at ``place`` (as :func:`rollout_routes`): top-k distinct experts, none of them the rollout's
    route of that token (a trainer's model routes differently from the rollout's: what router replay corrects), so
    a token whose route is not replayed is seen."""
    _, experts = ROUTE_DTYPES[dtype]
    return (rollout_routes(ids, dtype, place).to(torch.int64) + ROUTED_TOPK).remainder(experts)


def routes_handed(handed: list[torch.Tensor] | None, sequences: list[torch.Tensor], dtype: str,
                  read: list[int] | None = None) -> None:
    """The routes handed on, one ``(n_i, layers, top_k)`` tensor per sample (``handed``), are each sample's: the
    rollout's (:func:`rollout_routes` of its ``sequences`` ids) at every token a counted log-prob reads (``read[i]``:
    the sample's first rows, those before its last counted response token; default every captured row); at its
    other captured tokens the rollout's route or one of its own; at every token without the rollout's route top-k
    distinct experts in every layer."""
    if handed is None:
        raise AssertionError("the engine hands on no routed experts (the micro-batch carries them)")
    if len(handed) != len(sequences):
        raise AssertionError(f"routed experts handed for {len(handed)} samples, the micro-batch has {len(sequences)}")
    for i, (got, ids) in enumerate(zip(handed, sequences)):
        want = rollout_routes(ids, dtype)[:captured(ids.numel())]
        if tuple(got.shape) != (ids.numel(), ROUTED_LAYERS, ROUTED_TOPK):
            raise AssertionError(f"routed experts of sample {i}: shape {tuple(got.shape)}, expected "
                                 f"({ids.numel()}, {ROUTED_LAYERS}, {ROUTED_TOPK}): one route per token")
        rows = want.shape[0]
        must = rows if read is None else min(rows, read[i])
        differs = (got[:rows].to(torch.int64) != want.to(torch.int64)).flatten(1).any(1)
        wrong = differs[:must].nonzero().flatten()
        if wrong.numel():
            t = int(wrong[0])
            raise AssertionError(f"routed experts of sample {i} at token {t}: got {got[t].tolist()}, expected "
                                 f"{want[t].tolist()} (the rollout's route of that token"
                                 + (")" if read is None else f", read by a counted log-prob: tokens 0..{must - 1})"))
        own = torch.cat([got[:rows][differs], got[rows:]]).to(torch.int64)
        if own.numel() and bool((own.sort(-1).values.diff(dim=-1) == 0).any()):
            raise AssertionError(f"routed experts of sample {i}: a token without the rollout's route gets a "
                                 f"duplicate expert in its top-k {own.tolist()}")


#: the dtype an engine records routes in under R2 (verl's: int16), whose experts (:data:`ROUTE_DTYPES`) the stand-in
#: MoE model routes over while recording
RECORDED_DTYPE = "int16"


def routes_record(recorded: list[torch.Tensor] | None, sequences: list[torch.Tensor]) -> None:
    """Router replay's R2 record: the routes an engine returns, one ``(n_i, layers, top_k)`` tensor per sample
    (``recorded``), are those the stand-in MoE model's routers took at each of the sample's own tokens
    (:func:`model_routes` of its ``sequences`` ids, in :data:`RECORDED_DTYPE`'s experts), every token's, in token
    order: none of another sample's, none of the padding's (AssertionError naming the sample and token)."""
    if recorded is None:
        raise AssertionError("the engine returns no recorded routes (routed_experts) although it records them (R2)")
    if len(recorded) != len(sequences):
        raise AssertionError(f"routes recorded for {len(recorded)} samples, the micro-batch has {len(sequences)}")
    for i, (got, ids) in enumerate(zip(recorded, sequences)):
        want = model_routes(ids, RECORDED_DTYPE)
        if tuple(got.shape) != tuple(want.shape):
            raise AssertionError(f"recorded routes of sample {i}: shape {tuple(got.shape)}, expected "
                                 f"{tuple(want.shape)}: one route per token")
        wrong = (got.to(torch.int64).cpu() != want).flatten(1).any(1).nonzero().flatten()
        if wrong.numel():
            t = int(wrong[0])
            raise AssertionError(f"recorded routes of sample {i} at token {t}: got {got[t].tolist()}, expected "
                                 f"{want[t].tolist()} (the route the model's routers took at that token)")


def routes_of(micro_batch) -> list[torch.Tensor] | None:
    """A micro-batch's routed experts (:data:`ROUTES_KEY`) per sample: its nested tensor's, or a list handed as
    such (:func:`without_last_routes`); None where it carries none."""
    if ROUTES_KEY not in micro_batch.keys():
        return None
    value = micro_batch.get(ROUTES_KEY)
    return list(value.unbind()) if isinstance(value, torch.Tensor) else list(getattr(value, "data", value))


def captured_rows(routes: torch.Tensor) -> torch.Tensor:
    """A sample's captured routes: its rows before the all-zero ones of the tokens without a captured route."""
    return routes[routes.flatten(1).ne(0).any(1)]


def without_last_routes(micro_batch):
    """A copy of ``micro_batch`` whose routed experts miss its last sample's (a list of the others': a nested tensor
    cannot hold fewer samples than the batch)."""
    bad = micro_batch.copy()
    routes = routes_of(micro_batch)[:-1]
    del bad[ROUTES_KEY]
    bad.set_non_tensor(ROUTES_KEY, routes)
    return bad
