"""Router replay under Megatron-style packing (docs/contract.md, "Routed experts"; spec/truth/megatron_packing.py,
``replayed_routes`` / ``recorded_routes``): a mixture-of-experts model's routers hold each rank's packed rows, split
over the TP ranks, so every token's route must be packed as its id is. Each example checks one rank and two TP x CP
picked by the seed (CP zig-zag, no static bucket), R2 (record, then replay) and R3 (the rollout's routes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from tensordict import TensorDict

from ..protocol.engine import ShardLayout
from ..truth.megatron_packing import PackSpec, full_loss_mask, nested_from
from .core import Ctx, fail, invariant
from .megatron import ANY, NEEDS, _at, _poisoned_thd, _replaced, _same, _sampled, _specs


def _routes_batch(ctx: Ctx) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """A no_padding micro-batch (ids, a response mask with holes, temperatures), every token's route (``(B, j, layers,
    top_k)``: random experts, so a route on another token's row shows) and the rollout's routes (R3: a generating
    sequence's may lack its last token's, which no forward produced), from the seed."""
    gen = torch.Generator().manual_seed(ctx.case.seed)
    lens, responses = list(ctx.case.seq_lens), list(ctx.case.response_lens)
    layers, topk = (1, 2, 3)[ctx.case.seed % 3], (1, 2)[ctx.case.seed // 3 % 2]
    dtype = (torch.int16, torch.int32, torch.int64)[ctx.case.seed // 6 % 3]
    routes = [torch.randint(0, 256, (n, layers, topk), generator=gen).to(dtype) for n in lens]
    short = [n > 1 and r > 0 and bool(torch.rand((), generator=gen) < 0.5) for n, r in zip(lens, responses)]
    rollout = nested_from([r[:-1] if cut else r for r, cut in zip(routes, short)])
    response = nested_from([(torch.rand(r, generator=gen) < 0.75).to(torch.int64) for r in responses])
    micro_batch = TensorDict({"input_ids": nested_from([torch.randint(1, ctx.case.vocab, (n,), generator=gen)
                                                        for n in lens]),
                              "loss_mask": response, "response_mask": response.clone(),
                              "temperature": torch.ones(len(lens))}, batch_size=[len(lens)])
    return micro_batch, nested_from(routes), rollout


def _route_specs(ctx: Ctx) -> list[PackSpec]:
    """The packing's settings without a static bucket (verl refuses one with router replay), CP zig-zag (routes are
    packed as the model's attention packs its rows: contiguous CP is DeepSeek-V4's hybrid attention's; INV-MEG-001..004
    check contiguous CP's packing)."""
    specs = {replace(spec, bucket=None): None for spec in _specs(ctx)
             if spec.cp == 1 or spec.layout is ShardLayout.ZIGZAG}
    return _sampled(list(specs), ctx.case.seed, 2)


def _with_routes(micro_batch: Any, routes: torch.Tensor) -> Any:
    batch = micro_batch.copy()
    batch["routed_experts"] = routes
    return batch


def _reassembled(packer: Any, handed: list, routes: torch.Tensor, spec: PackSpec, what: str) -> tuple[Any, Any]:
    """Every rank's replayed routes and masks (its TP ranks' in order) re-assembled onto the tokens, as the ids'
    packing places them (the engine's own pack and unpack)."""
    shards = [packer.pack_thd(routes, spec, rank) for rank in range(spec.cp)]
    rows = [torch.cat(h.routes).unsqueeze(0) for h in handed]
    got = packer.unpack_thd(_replaced(shards, rows, f"{what} routes"), routes, spec)
    tokens = nested_from([torch.zeros(int(n)) for n in routes.offsets().diff()])  # one value a token
    masks = [torch.cat([m if m is not None else torch.ones(r.shape[0], dtype=torch.bool) for m, r in
                        zip(h.masks, h.routes)]).unsqueeze(0) for h in handed]
    flat = [packer.pack_thd(tokens, spec, rank) for rank in range(spec.cp)]
    replayed = packer.unpack_thd(_replaced(flat, masks, f"{what} replay mask"), tokens, spec)
    return got, replayed


def _replays(got: Any, replayed: Any, want: list[torch.Tensor], must: list[int], what: str) -> None:
    """Each row that replays holds its own token's route (where one was recorded: ``want[i]``'s rows), and the first
    ``must[i]`` rows of sequence ``i`` (every row its counted response tokens' log-probs read) replay."""
    for i, (routes, mask, recorded, n) in enumerate(zip(got.unbind(), replayed.unbind(), want, must)):
        mask = mask.bool()
        if not bool(mask[:n].all()):
            fail(f"{what}: sequence {i} replays rows {mask.nonzero().flatten().tolist()}, expected rows 0..{n - 1} "
                 "at least (every row a counted response token's log-prob reads)")
        k = recorded.shape[0]
        wrong = (mask[:k] & (routes[:k].to(torch.int64) != recorded.to(torch.int64)).flatten(1).any(1)).nonzero()
        if wrong.numel():
            t = int(wrong[0])
            fail(f"{what}: sequence {i} token {t} replays route {routes[t].to(torch.int64).tolist()}, its own is "
                 f"{recorded[t].to(torch.int64).tolist()}")


@invariant("INV-MEG-009", "router replay under TP x CP: every rank's routers (each TP rank its share of the rank's "
           "packed row) replay each token's own route: R2's routes recorded on every rank gather back to their "
           "tokens and replay there, R3's rollout routes (a sequence's last token's may be missing) likewise; every "
           "row before a sequence's last counted response token replays (one rank and two TP x CP picked by the "
           "seed per example, CP zig-zag)", contract=16, modes=ANY, needs=NEEDS,
           protects="a mixture-of-experts policy replays at each token the experts that token was routed to (in the "
                    "log-prob forward, R2, or the rollout, R3), so the training and rollout log-probs agree")
def router_replay(ctx: Ctx) -> None:
    micro_batch, routes, rollout = _routes_batch(ctx)
    packer = ctx.engine.packer
    lens = list(ctx.case.seq_lens)
    # the rows before a sequence's last counted response token: every row its counted log-probs read
    must = [int(m.nonzero().max()) if bool(m.any()) else 0 for m in
            full_loss_mask(micro_batch["response_mask"], lens).unbind()]
    pad = torch.iinfo(torch.int16).max
    for spec in _route_specs(ctx):
        with _at(spec):
            # what each TP rank's routers recorded on their rows; a padding row's route is never a token's
            recorded = [list(shard.rows[0].chunk(spec.tp)) for shard in _poisoned_thd(ctx, routes, spec, pad)]
            merged = packer.recorded_routes(micro_batch, recorded, spec)
        _same(merged.to(torch.int64), routes.to(torch.int64), f"R2 recorded routes [{spec}]")
        for mode, given in (("R2", merged), ("R3", rollout)):
            with _at(spec):
                handed = [packer.replayed_routes(_with_routes(micro_batch, given), spec, rank, mode=mode)
                          for rank in range(spec.cp)]
                got, replayed = _reassembled(packer, handed, routes, spec, f"{mode} [{spec}]")
            _replays(got, replayed, list(given.unbind()), must, f"{mode} replay [{spec}]")
