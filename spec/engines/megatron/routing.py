"""verl 0.9.1's Megatron router replay (R2 / R3) on one CP rank: what its routers are handed, and what it records.

A mixture-of-experts model trained with router replay (``engine_config.router_replay.mode`` R2 or R3) replays routes
instead of routing: ``MegatronEngineWithLMHead.forward_step`` (transformer_impl.py:1301-1324) takes the micro-batch's
``routed_experts`` (R3: the rollout's, aligned to the ids by ``align_r3_router_replay_data``, with
``build_r3_replay_mask``'s mask), and ``set_router_replay_data`` (router_replay_utils.py) packs them with
``preprocess_thd_engine`` as the ids are packed, scatters them over the TP ranks (sequence parallelism) and hands each
of the model's routers its layer's rows. R2 records them first, in the log-prob forward: each router keeps the top-k of
its rows and ``merge_router_topk_indices`` gathers them over TP and CP back to the tokens (``postprocess_thd_engine``).

:class:`VerlRouterReplay` runs ``forward_step`` itself up to the model call, on each TP rank of a CP rank, with a
mixture-of-experts stand-in whose routers are megatron's ``TopKRouter`` class (what ``iter_model_routers`` walks, one
per layer, each with its ``RouterReplay``); the model reads what its routers were handed and stops the forward. The
record runs ``merge_router_topk_indices`` as ``forward_step`` calls it after the model (line 1418).

:class:`EngineReplay` is R3 on the engine object (one rank, the ``routed_experts`` switch drawn as its users configure
it): the stand-in's routers fire through verl's ``RouterReplay.get_replay_topk`` on the model's token rows in
megatron's order, and the routes each token took are what INV-ROUTE-001 reads. THD only: BSHD is finding F28
(:data:`BSHD_REPLAY`).

The seams, each what a real run's setup fills: the engine object's configuration (:func:`engine_namespace`, router
replay on, no bucket: verl refuses one with router replay), megatron's parallel state (the packer's fake), megatron's
sequence-parallel scatter and gather over TP (``scatter_to_sequence_parallel_region``: the ``t``-th of TP equal
parts of the first dim; the gather: the TP ranks' parts concatenated in order) and ``get_device_id`` (the CPU).
Dynamic CP hands the micro-batch's ``local_cp_size`` and the router padding mask its scheduler builds
(``dynamic_cp_scheduler._local_padding_mask``, verl's own).
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import lru_cache, partial
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import torch

from ...protocol.errors import PartTaken
from ...truth.megatron_packing import PackSpec, RoutesHanded
from ...truth.routes import ROUTE_DTYPES, ROUTED_LAYERS, ROUTED_TOPK, model_routes
from ..kit import calls_seen_by_model, inputs_seen_by_model
from ..kit.stubs import import_verl_module
from .engine import (ONE_RANK, MegatronModel, engine_modules, engine_namespace, no_loss, no_terms, one_rank,
                     packed_rows, zero_logits)

__all__ = ["VerlRouterReplay", "EngineReplay", "MoeModel", "moe_config", "BSHD_REPLAY", "ROUTING_SURFACE",
           "ROUTING_UNREACHABLE"]

_RR = "verl.utils.megatron.router_replay_utils"
_SCHEDULER = "verl.utils.dynamic_cp_scheduler"
#: what router replay runs of verl around the packing
ROUTING_SURFACE = (f"{_RR}:set_router_replay_data", f"{_RR}:merge_router_topk_indices", f"{_RR}:build_r3_replay_mask",
                   f"{_RR}:align_r3_router_replay_data", f"{_RR}:iter_model_routers",
                   f"{_RR}:set_model_router_replay_action", f"{_RR}:RouterReplayHelper._get_action_router_list",
                   f"{_RR}:RouterReplayHelper.is_replay_forward_action",
                   f"{_RR}:RouterReplayHelper.is_replay_backward_action")
_ERROR = ("an error path: verl raises for an input it rejects (replay data that does not cover the model's routers, "
          "a route row count that is not the sequence's); the suite's valid cases never take it")
_BSHD = ("dead code for forward_step in verl 0.9.1: its micro-batches are no_padding's (nested ids and routes), so "
         "the padded (B, S) routes with an attention mask (preprocess_packed_seqs) are never handed")
_REGISTRY = ("dead code for forward_step in verl 0.9.1: it always hands the forwarded model, so the routers are the "
             "model's own (iter_model_routers), never a positional slice of the process-global registry")
_NO_ROUTERS = ("another model family's configuration: a pipeline stage without MoE layers (a dense stage of a "
               "mixed dense/MoE model) records an empty route map")
#: why the engine object runs router replay on THD micro-batches only (the profile's ``routes_note``)
BSHD_REPLAY = ("with use_remove_padding=False (BSHD) verl 0.9.1's forward_step still packs the routes THD "
               "(set_router_replay_data on the nested routes) while a BSHD model's routers read its (S, B) token "
               "rows: equal-length samples silently replay other tokens' routes, other batches raise 'Router replay "
               "tensors are not aligned' (docs/findings/F28-megatron-bshd-router-replay.md, its reproducer and "
               "tests/test_adapters.py pin both)")
#: branches of :data:`ROUTING_SURFACE` router replay never takes, each with its reason
ROUTING_UNREACHABLE: dict[str, str] = {
    **{f"{_RR}:{line}": _REGISTRY for line in ("270->280", "525->549", "557", "558", "825->827")},
    **{f"{_RR}:{line}": _NO_ROUTERS for line in ("282->283", "284->289", "290->295", "295")},
    **{f"{_RR}:{line}": _BSHD for line in ("344->369", "480->499", "499->501")},
    **{f"{_RR}:{line}": _ERROR for line in ("311->312", "534->535")},
}


def _routers(utils: Any, layers: int) -> torch.nn.Module:
    """A decoder of ``layers`` megatron ``TopKRouter`` modules (layer numbers from 1), each with a ``RouterReplay``
    (verl's patch's: what ``iter_model_routers`` yields; ``utils``: router_replay_utils, which imports both) and no
    weights: only the replay state is read."""
    decoder = torch.nn.Module()
    for layer in range(layers):
        router = utils.TopKRouter.__new__(utils.TopKRouter)
        torch.nn.Module.__init__(router)
        router.layer_number = layer + 1
        router.router_replay = utils.RouterReplay()
        decoder.add_module(f"router{layer}", router)
    return decoder


class MoeModel(MegatronModel):
    """The model ``forward_step`` is handed: a mixture-of-experts decoder of routers (:func:`_routers`) and, with
    ``vp_stage``, a model chunk of a virtual pipeline stage."""

    def __init__(self, utils: Any, call: Callable[..., Any], spec: PackSpec, layers: int, *, vp_stage: bool = False):
        super().__init__(call, spec)
        self.decoder = _routers(utils, layers)
        if vp_stage:
            self.vp_stage = 0

    def routers(self) -> list[Any]:
        return [module.router_replay for module in self.decoder.children()]


def moe_config(spec: PackSpec, layers: int, topk: int) -> SimpleNamespace:
    """What ``forward_step`` and router replay read of megatron's TransformerConfig: a MoE model of ``layers`` layers,
    every one a MoE layer, ``topk`` experts a token, FP8 as ``spec``."""
    return SimpleNamespace(calculate_per_token_loss=False, fp8="e4m3" if spec.fp8 else None, num_layers=layers,
                           moe_router_topk=topk, experimental_attention_variant=None,
                           virtual_pipeline_model_parallel_size=None)


@lru_cache(maxsize=None)
def _router_replay_utils() -> Any:
    """verl's router_replay_utils, imported once for every engine object (an engine object is made per example)."""
    return import_verl_module("verl-megatron", _RR, ("megatron",))[1].module


def replay_seams(utils: Any, spec: PackSpec, tp_rank: int, gather: Callable[..., torch.Tensor]) -> ExitStack:
    """What router replay reads of a real run's setup (``utils``: router_replay_utils), patched now until the stack
    closes, as :func:`~spec.engines.megatron.engine.one_rank`: megatron's sequence-parallel scatter over TP as TP rank
    ``tp_rank`` sees it (the ``tp_rank``-th of TP equal parts of the first dim), the gather ``gather``, router
    replay's device (the CPU), and a registry of routers of this run's own (every ``RouterReplay`` registers itself
    process-wide: without it each run's routers, and the routes they hold, would stay)."""
    def scatter(input_: torch.Tensor, group: Any = None) -> torch.Tensor:
        if input_.shape[0] % spec.tp:
            raise ValueError(f"scatter_to_sequence_parallel_region: first dim {input_.shape[0]} is not divisible "
                             f"by the TP size {spec.tp}")
        return input_.chunk(spec.tp)[tp_rank].contiguous()

    stack = ExitStack()
    stack.enter_context(mock.patch.object(utils, "scatter_to_sequence_parallel_region", scatter))
    stack.enter_context(mock.patch.object(utils, "gather_from_sequence_parallel_region", gather))
    stack.enter_context(mock.patch.object(utils.RouterReplay, "router_instances", []))
    stack.enter_context(mock.patch.object(utils, "device_name", "cpu"))
    return stack


class EngineReplay:
    """R3 router replay on the engine object (one rank, spec/engines/megatron/engine.py): ``forward_step`` with
    ``router_replay.mode`` R3 hands the model's routers the micro-batch's ``routed_experts`` (the rollout's,
    :mod:`spec.truth.routes`); the stand-in's routers (:class:`MoeModel`) fire when the model runs, each on the
    model's token rows in megatron's order (its hidden states are ``(S, B, H)``: THD's one packed row, BSHD's columns
    one after another, as ``TopKRouter.routing`` flattens them), its own top-k :func:`~spec.truth.routes.model_routes`
    scored, through verl's ``RouterReplay.get_replay_topk`` (the replayed route where the replay mask says, its own
    elsewhere). ``per_sample`` returns the routes each sample's tokens took (``InputsView.routes``)."""

    def __init__(self, dtype: str, *, bshd: bool = False):
        #: ``bshd``: also on BSHD micro-batches (F28's reproduction; the profile runs THD only: :data:`BSHD_REPLAY`)
        self.dtype, self.bshd = dtype, bshd
        self.utils = _router_replay_utils()
        self.taken: torch.Tensor | None = None

    def armed(self, engine: Any, call: Callable[..., Any], spec: PackSpec) -> MoeModel:
        """Turn R3 on in ``engine`` (the namespace ``forward_step`` reads) and return the model whose routers fire
        when it is called, before ``call``."""
        engine.enable_routing_replay = True
        engine.engine_config.router_replay = SimpleNamespace(mode="R3")
        engine.tf_config = moe_config(spec, ROUTED_LAYERS, ROUTED_TOPK)
        self.taken = None

        def run(**kwargs: Any) -> Any:
            ids, params = kwargs["input_ids"], kwargs.get("packed_seq_params")
            if params is not None and kwargs.get("attention_mask") is not None:  # a VL model packs its rows itself
                ids = packed_rows(ids.unsqueeze(-1), kwargs["attention_mask"],
                                  params.cu_seqlens_q_padded.to(torch.int64)).squeeze(-1)
            self.taken = self._fire(model, ids)
            return call(**kwargs)

        model = MoeModel(self.utils, run, spec, ROUTED_LAYERS)
        for router in model.routers():
            router.router_replay_action = self.utils.RouterReplayAction.REPLAY_FORWARD
        return model

    def active(self) -> ExitStack:
        """The seams while ``forward_step`` runs (:func:`replay_seams`), one TP rank: the model is made inside them
        (:meth:`armed`), so its routers never join the process-wide registry."""
        return replay_seams(self.utils, ONE_RANK, 0, _no_gather)

    def _fire(self, model: MoeModel, ids: torch.Tensor) -> torch.Tensor:
        """Every router's route per token row, ``(rows, layers, top_k)`` in megatron's row order."""
        rows = ids.transpose(0, 1).reshape(-1)  # (S, B) flattened: THD's (1, T) row as it is
        _, experts = ROUTE_DTYPES[self.dtype]
        taken = []
        for layer, router in enumerate(model.routers()):
            own = model_routes(rows, self.dtype, torch.arange(rows.numel()))[:, layer]
            scores = torch.zeros(rows.numel(), experts)
            scores.scatter_(1, own, torch.arange(ROUTED_TOPK, 0, -1, dtype=scores.dtype).expand_as(own).clone())
            taken.append(router.get_replay_topk(scores, ROUTED_TOPK, default_compute_topk=_topk)[1])
        return torch.stack(taken, dim=1).to(torch.int64)

    def per_sample(self, handed: dict[str, Any], params: Any, lens: list[int]) -> list[torch.Tensor]:
        """The routes each sample's tokens took: THD at its packed boundaries (``params``), BSHD in its row."""
        if self.taken is None:
            raise AssertionError("the model was not called: no router fired")
        if params is not None:
            starts = params.cu_seqlens_q_padded.tolist()
            return [self.taken[start:start + n] for start, n in zip(starts, lens)]
        batch, width = handed["input_ids"].shape
        dense = self.taken.reshape(width, batch, *self.taken.shape[1:]).transpose(0, 1)
        return [dense[i, :n] for i, n in enumerate(lens)]


def _topk(scores: torch.Tensor, topk: int, num_groups: Any = None, group_topk: Any = None) -> tuple[Any, Any]:
    """A router's own top-k (megatron's ``topk_routing_with_score_function`` without groups): probabilities, experts."""
    top = scores.topk(topk, dim=-1)
    return top.values, top.indices


class VerlRouterReplay:
    """Router replay and record through verl's own code on one CP rank (the module docstring)."""

    def __init__(self) -> None:
        self.modules = engine_modules()
        self.impl = self.modules[0]
        self.utils = import_verl_module("verl-megatron", _RR, ("megatron",))[1].module
        self.scheduler = import_verl_module("verl-megatron", _SCHEDULER, ("megatron",))[1].module

    def replayed(self, micro_batch: Any, spec: PackSpec, rank: int, rank_context: Callable[..., Any], *, mode: str,
                 backward_first: bool = False, vp_stage: bool = False) -> RoutesHanded:
        """What ``rank``'s routers are handed on each TP rank: ``forward_step`` up to the model call (``mode`` R2 or
        R3; ``backward_first``: the routers left in REPLAY_BACKWARD by the previous micro-batch's backward, as
        ``forward_step`` finds them between micro-batches; ``vp_stage``: the model a chunk of a virtual stage)."""
        routes = micro_batch["routed_experts"]
        layers, topk = int(routes.values().shape[1]), int(routes.values().shape[2])
        batch = micro_batch.copy()
        if spec.dynamic:
            lens = micro_batch["input_ids"].offsets().diff().tolist()
            tu = self.scheduler.tu
            tu.assign_non_tensor_data(batch, "local_cp_size", spec.cp)
            tu.assign_non_tensor_data(batch, self.scheduler.DCP_PADDING_MASK, self.scheduler._local_padding_mask(
                lens, cp_size=spec.cp, cp_rank=rank, tp_size=spec.tp))
        engine = engine_namespace(self.impl, micro_batch, packed=True, replay=mode, dynamic=spec.dynamic)
        engine.tf_config = moe_config(spec, layers, topk)
        action = self.utils.RouterReplayAction.REPLAY_BACKWARD if backward_first else \
            self.utils.RouterReplayAction.REPLAY_FORWARD
        handed = RoutesHanded([], [])
        for tp_rank in range(spec.tp):
            models: list[MoeModel] = []

            def forward(recorder: Callable[..., Any]) -> Any:
                model = MoeModel(self.utils, recorder, spec, layers, vp_stage=vp_stage)
                for router in model.routers():
                    router.router_replay_action = action
                models.append(model)
                return self.impl.MegatronEngineWithLMHead.forward_step(engine, iter([batch]), model, no_terms,
                                                                       no_loss)

            if _one(spec):  # forward_step to its end (the routers then left for the backward's replay)
                with one_rank(rank_context, self.modules), replay_seams(self.utils, spec, tp_rank, _no_gather):
                    calls_seen_by_model(forward, zero_logits)
            else:
                with rank_context(spec, rank), replay_seams(self.utils, spec, tp_rank, _no_gather), \
                        mock.patch.object(self.impl, "get_device_id", lambda: "cpu"):
                    inputs_seen_by_model(forward)
            routers = models[0].routers()
            if any(router.target_topk_idx is None for router in routers):
                raise AssertionError(f"[{spec}] rank {rank} TP rank {tp_rank}: a router was handed no route to replay")
            handed.routes.append(torch.stack([router.target_topk_idx for router in routers], dim=1))
            handed.masks.append(routers[0].target_replay_mask)
        return handed

    def recorded(self, micro_batch: Any, recorded: list[list[torch.Tensor]], spec: PackSpec,
                 rank_context: Callable[..., Any], local_cp_size: int | None) -> torch.Tensor:
        """R2's record of the micro-batch's routes (``recorded[cp][tp]``: what each rank's routers recorded on their
        rows). On one rank, ``forward_step`` to its end with ``record_r2_routes``, the routers recording as the model
        runs (its ``merge_router_topk_indices``, line 1418); on more, that merge as ``forward_step`` calls it after
        the model (nested ids, no attention mask, the model's routers): each TP rank's part as it hands it to the TP
        gather, then every CP rank's merge of its TP ranks' parts gathered (re-assembled over CP by
        ``postprocess_thd_engine``)."""
        layers, topk = int(recorded[0][0].shape[1]), int(recorded[0][0].shape[2])
        config = moe_config(spec, layers, topk)
        ids = micro_batch["input_ids"]
        if _one(spec):
            return self._recorded_by_step(micro_batch, recorded[0][0], spec, rank_context, config)

        def merge(cp_rank: int, tp_rank: int, gather: Callable[..., torch.Tensor],
                  cp_gathered: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
            into: list[torch.Tensor] = []
            with rank_context(spec, cp_rank, cp_gathered), replay_seams(self.utils, spec, tp_rank, gather):
                model = MoeModel(self.utils, _never_called, spec, layers)
                for layer, router in enumerate(model.routers()):
                    router.recorded_topk_idx = recorded[cp_rank][tp_rank][:, layer]
                self.utils.merge_router_topk_indices(None, ids, into, config, 0, local_cp_size=local_cp_size,
                                                     model=model)
            return into

        parts: list[list[torch.Tensor]] = []  # per CP rank, per TP rank: the part each hands the TP gather
        for cp_rank in range(spec.cp):
            parts.append([])
            for tp_rank in range(spec.tp):
                def capture(input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                    parts[-1].append(input_)
                    raise PartTaken

                try:
                    merge(cp_rank, tp_rank, capture)
                except PartTaken:
                    pass
        gathered = [torch.cat(p).unsqueeze(0) for p in parts]
        merged = [merge(cp_rank, 0, partial(_concatenated, parts[cp_rank]), gathered)[0] for cp_rank in range(spec.cp)]
        for cp_rank, out in enumerate(merged[1:], 1):
            if not all(torch.equal(a, b) for a, b in zip(out.unbind(), merged[0].unbind())):
                raise AssertionError(f"[{spec}] CP rank {cp_rank} merges other routes than rank 0")
        return merged[0]


    def _recorded_by_step(self, micro_batch: Any, rows: torch.Tensor, spec: PackSpec, rank_context: Callable[..., Any],
                          config: SimpleNamespace) -> torch.Tensor:
        """``forward_step`` of an R2 record forward (the routers in RECORD, ``record_r2_routes``) on one rank: the
        model's routers record ``rows`` (their rows' routes) when it runs; what ``forward_step`` merges."""
        batch = micro_batch.copy()
        self.scheduler.tu.assign_non_tensor_data(batch, "record_r2_routes", True)
        engine = engine_namespace(self.impl, micro_batch, packed=True, replay="R2")
        engine.tf_config, engine.mini_layer_topk_idx_list = config, []
        layers = int(rows.shape[1])

        def forward(recorder: Callable[..., Any]) -> Any:
            def run(**kwargs: Any) -> Any:
                for layer, router in enumerate(model.routers()):
                    router.recorded_topk_idx = rows[:, layer]
                return recorder(**kwargs)

            model = MoeModel(self.utils, run, spec, layers)
            for router in model.routers():
                router.router_replay_action = self.utils.RouterReplayAction.RECORD
            return self.impl.MegatronEngineWithLMHead.forward_step(engine, iter([batch]), model, no_terms, no_loss)

        with one_rank(rank_context, self.modules), replay_seams(self.utils, spec, 0, partial(_concatenated, [])):
            calls_seen_by_model(forward, zero_logits)
        if len(engine.mini_layer_topk_idx_list) != 1:
            raise AssertionError(f"[{spec}] forward_step with record_r2_routes merged "
                                 f"{len(engine.mini_layer_topk_idx_list)} route maps, expected one")
        return engine.mini_layer_topk_idx_list[0]


def _one(spec: PackSpec) -> bool:
    """One rank (TP = CP = 1, no dynamic CP): where ``forward_step`` runs to its end."""
    return spec.tp == 1 and spec.cp == 1 and not spec.dynamic


def _concatenated(parts: list[torch.Tensor], input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Megatron's sequence-parallel gather over TP: every TP rank's part (``parts``; none: one TP rank, its own),
    concatenated in order."""
    return torch.cat(parts) if parts else input_


def _no_gather(input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    raise AssertionError("router replay gathered over TP where it only scatters")


def _never_called(**kwargs: Any) -> None:
    raise AssertionError("the record's model is never called (its routers recorded already)")
