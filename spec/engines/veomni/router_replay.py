"""Router replay (R3, and R2's record) through verl's VeOmni engine (engine ``verl-veomni``; docs/contract.md, "Routed
experts").

With ``engine_config.router_replay.mode`` R3, VeOmni's engine arms its ``VeOmniRouterReplay`` controller in REPLAY
for every forward (``forward_backward_batch``, transformer_impl.py:436-440) and, per micro-batch, hands it the
micro-batch's ``routed_experts`` as per-layer targets over the packed row, the pad suffix appended
(``_prepare_router_replay_inputs``). Each MoE layer's router then calls VeOmni's hook
``veomni.utils.moe_router_replay.maybe_replay_indices`` with its own top-k; the controller returns the target where
the row is a captured route and the router's own top-k where it is not (an all-zero row: the rollout's uncaptured
tokens, the pad). After the forward, ``prepare_model_outputs`` checks that every layer's router fired.

The suite's stand-in model is dense. The adapter stands in for the MoE model's routers (:class:`StandInRouter`, one
per layer of :data:`~spec.truth.routes.ROUTED_LAYERS`, each routing a token by :func:`~spec.truth.routes.
model_routes`, never the rollout's route): they fire through VeOmni's hook on the model inputs right after the
engine armed the controller, as the model's forward fires them, and the routes they end up taking, the pad suffix
cut, per sample, are the ``routes`` INV-ROUTE-001 reads. A target handed one token late, or to another sample, or
never handed, routes a token other than by its rollout's route. A stand-in router routes a token by its id and its
place in its own sequence (the packed row's boundaries the model's varlen attention reads, ``cu_seq_lens_q``), as a
real router's hidden state depends on the token's own sequence only.

With R2 (the switch's value ``record``: ``compute_log_prob`` under ``router_replay.mode`` R2, ``forward_only``), the
engine arms the controller in RECORD instead (``begin_record``): the routers route on their own, the controller
records each layer's top-k, and ``prepare_model_outputs`` returns them, the pad suffix dropped, per sample, as the
output ``routed_experts`` (int16), which INV-ROUTE-002 reads (``OutputsView.routes``). The micro-batch carries no
routes then (R2's rollout captures none).

VeOmni's engine refuses router replay without ``use_remove_padding`` (``VeOmniEngine.__init__``), so the switch
applies to packed micro-batches only (the profile's ``routes_modes``).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ...protocol.profile import ROUTES_RECORDED, ROUTES_SWITCH, ConfigSwitch
from ...truth.routes import RECORDED_DTYPE, ROUTE_DTYPES, ROUTED_LAYERS, ROUTED_TOPK, model_routes, places

__all__ = ["ROUTER_REPLAY", "StandInRouter", "RouterReplay", "replay_hooks", "row_places"]

#: VeOmni's router hook module (``set_active_replay``, ``maybe_replay_indices``)
HOOKS = "veomni.utils.moe_router_replay"

#: the switch: the rollout's routed experts (R3), in a dtype the rollout hands them in, or R2's record; off: router
#: replay disabled
ROUTER_REPLAY = ConfigSwitch(
    ROUTES_SWITCH, (None, *ROUTE_DTYPES, ROUTES_RECORDED),
    text="engine_config.router_replay.mode R3: the micro-batch's routed_experts (the rollout's, in this dtype) "
         "replayed through VeOmni's VeOmniRouterReplay controller on every forward; 'record': mode R2 in "
         "compute_log_prob (forward_only), the routers' own routes recorded by the controller and returned as the "
         "output routed_experts (packed micro-batches only: VeOmni's engine refuses router replay without "
         "use_remove_padding)")


def replay_hooks() -> tuple[Any, str | None]:
    """VeOmni's router hook module and None, or None and why it does not import (a stubbed veomni: router replay
    is not run)."""
    try:
        return importlib.import_module(HOOKS), None
    except Exception as error:  # a stubbed veomni, or one older than router replay
        return None, f"{type(error).__name__}: {error}"


class StandInRouter(torch.nn.Module):
    """One MoE layer's router of the model the stand-in stands for: its own top-k for the tokens of a packed row
    (:func:`~spec.truth.routes.model_routes` at the layer), handed through VeOmni's hook as a patched
    ``SparseMoeBlock.forward`` hands them; returns the indices the layer routes by."""

    def __init__(self, layer: int, hook: Callable[..., torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.hook = hook

    def forward(self, ids: torch.Tensor, place: torch.Tensor, dtype: str) -> torch.Tensor:
        _, experts = ROUTE_DTYPES[dtype]
        own = model_routes(ids, dtype, place)[:, self.layer]  # (n, top_k)
        scores = torch.zeros(ids.numel(), experts)
        scores.scatter_(1, own, torch.arange(ROUTED_TOPK, 0, -1, dtype=scores.dtype).expand_as(own).clone())
        return self.hook(self, scores, scores.topk(ROUTED_TOPK, dim=-1).indices)


def row_places(model_inputs: dict, n: int) -> torch.Tensor:
    """Each of a packed row's ``n`` tokens' place in its own sequence (:func:`~spec.truth.routes.places`), by the
    boundaries the model's varlen attention reads (``cu_seq_lens_q``; the pad suffix past the last boundary counts
    from there); the row's index where the engine hands none."""
    bounds = model_inputs.get("cu_seq_lens_q")
    return places(bounds, n) if isinstance(bounds, torch.Tensor) else torch.arange(n)


class RouterReplay:
    """The router replay of one engine object: the controller (``VeOmniRouterReplay``, in REPLAY as
    ``forward_backward_batch`` arms it for R3, in RECORD for R2's ``compute_log_prob``: ``mode`` ``record``), the
    routers and the experts they route over (R3: the drawn route dtype's; R2: :data:`~spec.truth.routes.
    RECORDED_DTYPE`'s).

    ``arm(engine, packed)`` sets the engine's controller for a micro-batch (None for a padded one: VeOmni never runs
    router replay on it); ``fire(model_inputs, output_args, micro_batch)`` runs the routers on the model inputs
    and returns the routes they took, per sample."""

    def __init__(self, controller_class: type, hooks: Any, mode: str):
        self.controller = controller_class()
        self.record = mode == ROUTES_RECORDED
        if self.record:
            self.controller.begin_record()
        else:
            self.controller.begin_replay()
        self.hooks = hooks  # veomni.utils.moe_router_replay
        self.dtype = RECORDED_DTYPE if self.record else mode
        self.routers = [StandInRouter(layer, hooks.maybe_replay_indices) for layer in range(ROUTED_LAYERS)]

    def arm(self, engine: Any, packed: bool) -> None:
        engine._router_replay = self.controller if packed else None

    @contextmanager
    def _active(self) -> Iterator[None]:
        previous = self.hooks.get_active_replay()
        self.hooks.set_active_replay(self.controller)
        try:
            yield
        finally:
            self.hooks.set_active_replay(previous)

    def fire(self, model_inputs: dict, output_args: dict, micro_batch: Any) -> list[torch.Tensor]:
        """The routes each sample's tokens take, ``(n_i, layers, top_k)`` int64: the routers fired on the packed
        ``input_ids`` (the pad suffix included, as the model sees it), the pad cut off, split at the micro-batch's
        offsets."""
        ids = model_inputs["input_ids"].reshape(-1)
        place = row_places(model_inputs, ids.numel())
        with self._active():
            taken = torch.stack([router(ids, place, self.dtype) for router in self.routers], dim=1).to(torch.int64)
        pad = int(output_args.get("pad_size", 0) or 0)
        lens = micro_batch["input_ids"].offsets().diff().tolist()
        return list(taken[:taken.shape[0] - pad].split(lens))
