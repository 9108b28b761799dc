"""Router replay (R3) through verl's VeOmni engine (engine ``verl-veomni``; docs/contract.md, "Routed experts").

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
never handed, routes a token other than by its rollout's route.

VeOmni's engine refuses router replay without ``use_remove_padding`` (``VeOmniEngine.__init__``), so the switch
applies to packed micro-batches only (the profile's ``routes_modes``).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from ...protocol.profile import ROUTES_SWITCH, ConfigSwitch
from ...truth.routes import ROUTE_DTYPES, ROUTED_LAYERS, ROUTED_TOPK, model_routes

__all__ = ["ROUTER_REPLAY", "StandInRouter", "RouterReplay", "replay_hooks"]

#: VeOmni's router hook module (``set_active_replay``, ``maybe_replay_indices``)
HOOKS = "veomni.utils.moe_router_replay"

#: the switch: the rollout's routed experts (R3), in a dtype the rollout hands them in; off: router replay disabled
ROUTER_REPLAY = ConfigSwitch(
    ROUTES_SWITCH, (None, *ROUTE_DTYPES),
    text="engine_config.router_replay.mode R3: the micro-batch's routed_experts (the rollout's, in this dtype) "
         "replayed through VeOmni's VeOmniRouterReplay controller on every forward (packed micro-batches only: "
         "VeOmni's engine refuses router replay without use_remove_padding)")


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

    def forward(self, ids: torch.Tensor, dtype: str) -> torch.Tensor:
        _, experts = ROUTE_DTYPES[dtype]
        own = model_routes(ids, dtype, torch.arange(ids.numel()))[:, self.layer]  # (n, top_k)
        scores = torch.zeros(ids.numel(), experts)
        scores.scatter_(1, own, torch.arange(ROUTED_TOPK, 0, -1, dtype=scores.dtype).expand_as(own).clone())
        return self.hook(self, scores, scores.topk(ROUTED_TOPK, dim=-1).indices)


class RouterReplay:
    """The R3 router replay of one engine object: the controller (``VeOmniRouterReplay``, in REPLAY as
    ``forward_backward_batch`` arms it), the routers and the route dtype drawn.

    ``arm(engine, packed)`` sets the engine's controller for a micro-batch (None for a padded one: VeOmni never runs
    router replay on it); ``fire(model_inputs, output_args, micro_batch)`` runs the routers on the model inputs
    and returns the routes they took, per sample."""

    def __init__(self, controller_class: type, hooks: Any, dtype: str):
        self.controller = controller_class()
        self.controller.begin_replay()
        self.hooks = hooks  # veomni.utils.moe_router_replay
        self.dtype = dtype
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
        with self._active():
            taken = torch.stack([router(ids, self.dtype) for router in self.routers], dim=1).to(torch.int64)
        pad = int(output_args.get("pad_size", 0) or 0)
        lens = micro_batch["input_ids"].offsets().diff().tolist()
        return list(taken[:taken.shape[0] - pad].split(lens))
