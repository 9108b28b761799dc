"""An MoE rollout's routed experts (docs/contract.md, "Routed experts"; spec/truth/routes.py): the micro-batch carries
each sample's captured routes where the engine's routed_experts switch is drawn, and INV-ROUTE-001's check tells a
route moved to another token or sample, and a duplicate expert where no route was captured."""

from __future__ import annotations

import pytest
import torch

from spec.cases import EngineCase
from spec.cases.materialize import draws, materialize
from spec.cases.strategies import with_pinned_switches
from spec.planted.outputs_bugs import RECORDS
from spec.protocol.profile import ConfigSwitch, routes_dtype, routes_recorded
from spec.truth.routes import (RECORDED_DTYPE, ROUTES_KEY, captured, captured_rows, model_routes, rollout_routes,
                               routes_handed, routes_record, without_last_routes)

CASE = EngineCase(prompt_lens=(3, 1, 2), response_lens=(2, 1, 0), vocab=16, temperature=0.7,
                  engine_config=(("routed_experts", "uint8"),))


def _handed() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Routes handed on as a correct engine hands them: captured rows, then distinct experts 0..k-1."""
    ids = list(draws(CASE).ids.split(list(CASE.seq_lens)))
    handed = []
    for seq in ids:
        rows = rollout_routes(seq, "uint8")[:captured(seq.numel())]
        rest = torch.arange(rows.shape[-1], dtype=rows.dtype).expand(seq.numel() - rows.shape[0], *rows.shape[1:])
        handed.append(torch.cat([rows, rest]))
    return handed, ids


def test_the_micro_batch_carries_each_samples_captured_routes() -> None:
    mb = materialize(CASE)
    routes, ids = list(mb[ROUTES_KEY].unbind()), list(draws(CASE).ids.split(list(CASE.seq_lens)))
    assert [r.shape[0] for r in routes] == list(CASE.seq_lens) and all(r.dtype == torch.uint8 for r in routes)
    assert ROUTES_KEY not in materialize(CASE.with_(engine_config=())).keys()
    for got, seq in zip(routes, ids):
        rows = captured_rows(got)
        assert rows.shape[0] == max(1, seq.numel() - 1) and not got[rows.shape[0]:].any()  # then zero rows
        assert torch.equal(rows, rollout_routes(seq, "uint8")[:rows.shape[0]])
        assert bool((rows[..., 0] != rows[..., 1]).all())  # each token's top-k distinct


def test_routes_handed_tells_a_moved_route_and_a_duplicate() -> None:
    handed, ids = _handed()
    routes_handed(handed, ids, "uint8")
    shifted = [handed[1], handed[0], handed[2]]
    with pytest.raises(AssertionError):
        routes_handed(shifted, ids, "uint8")
    rolled = [handed[0].roll(1, 0), *handed[1:]]
    with pytest.raises(AssertionError, match="sample 0 at token"):
        routes_handed(rolled, ids, "uint8")
    duplicate = [h.clone() for h in handed]
    duplicate[0][-1] = 0
    with pytest.raises(AssertionError, match="duplicate expert"):
        routes_handed(duplicate, ids, "uint8")
    with pytest.raises(AssertionError, match="no routed experts"):
        routes_handed(None, ids, "uint8")


def test_without_last_routes_drops_the_last_samples() -> None:
    mb = materialize(CASE)
    bad = without_last_routes(mb)
    assert len(bad.get(ROUTES_KEY).data) == CASE.batch_size - 1 and ROUTES_KEY in mb.keys()
    assert isinstance(mb[ROUTES_KEY], torch.Tensor)  # the micro-batch itself left as it was


RECORD = CASE.with_(engine_config=(("routed_experts", "record"),))


def test_a_recording_case_carries_no_routes_and_pins_to_record() -> None:
    """R2's record: the switch's value ``record`` is no routes dtype (the micro-batch carries none); pinning the switch
    for INV-ROUTE-001 draws a dtype, for INV-ROUTE-002 the record, and an engine whose switch lacks the record lacks
    the feature (skipped, never run with 0 examples)."""
    assert routes_dtype(RECORD) is None and routes_recorded(RECORD) and not routes_recorded(CASE)
    assert ROUTES_KEY not in materialize(RECORD).keys()
    both = ConfigSwitch("routed_experts", (None, "int16", "record"))
    bare = CASE.with_(engine_config=())
    assert with_pinned_switches(bare, (both,), routes=True).engine_config == (("routed_experts", "int16"),)
    assert with_pinned_switches(bare, (both,), routes="record").engine_config == (("routed_experts", "record"),)
    assert with_pinned_switches(bare, (RECORDS,), routes=True).engine_config == ()


def test_routes_record_tells_a_moved_record_and_padding_rows() -> None:
    """INV-ROUTE-002's check: each sample's record is the stand-in routers' own routes at its tokens; a record one
    token late, another sample's, one keeping a padding row, or none at all fails it, naming the sample."""
    ids = list(draws(CASE).ids.split(list(CASE.seq_lens)))
    good = [model_routes(seq, RECORDED_DTYPE).to(torch.int16) for seq in ids]
    routes_record(good, ids)
    with pytest.raises(AssertionError, match="sample 0 at token"):
        routes_record([good[0].roll(1, 0), *good[1:]], ids)
    with pytest.raises(AssertionError, match="sample 0"):
        routes_record([good[1], good[0], good[2]], ids)
    with pytest.raises(AssertionError, match="shape"):
        routes_record([torch.cat([good[0], good[0][:1]]), *good[1:]], ids)
    with pytest.raises(AssertionError, match="no recorded routes"):
        routes_record(None, ids)
    assert not torch.equal(model_routes(ids[0], RECORDED_DTYPE), rollout_routes(ids[0], RECORDED_DTYPE).long())
