"""Process topologies on real ranks (spec/cases/topology.py): SP groups that start at a global rank other than 0,
several groups in one world, interleaved groups, each group running its own micro-batch.

Worked cases: impl on a shifted and on interleaved groups equals its single-rank run group by group, with each
rank's labels its group rank's slice; the planted ``rank_sp_rank_from_global_rank`` (the SP rank taken as the
global rank mod sp) passes on one group [0, sp) and fails the rank checks, naming the group, where a group
starts elsewhere or interleaves. tests/test_power.py re-checks its rejection under ``ci``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import find, settings

import impl
from spec.cases.structure import EngineCase
from spec.cases.topology import Topology, layouts
from spec.cases.topology_draws import topologies
from spec.execute import ranks
from spec.execute.harness import execute
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.planted import planted_engine
from spec.run.registry import load_engine

SEED = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=(0.5, 2.0), calculate_entropy=True)
SHIFTED = Topology(((1, 2),))
INTERLEAVED = Topology(((0, 2), (1, 3)))
needs_ranks = pytest.mark.skipif(ranks.unavailable("cpu") is not None, reason=str(ranks.unavailable("cpu")))


def test_topology_names_its_groups_and_layout() -> None:
    assert (INTERLEAVED.sp, INTERLEAVED.dp, INTERLEAVED.ranks, INTERLEAVED.world) == (2, 2, (0, 1, 2, 3), 4)
    assert [t.layout for t in (Topology.single(3), SHIFTED, Topology(((0, 1), (2, 3))), INTERLEAVED)] == \
        ["single", "shifted", "contiguous", "interleaved"]
    assert INTERLEAVED.group_of(2) == 0 and INTERLEAVED.group_of(1) == 1 and SHIFTED.group_of(0) is None
    assert INTERLEAVED.group_case(SEED, 0) is SEED and INTERLEAVED.group_case(SEED, 1) == SEED.with_(seed=1)
    assert "sp_groups=[[0, 2], [1, 3]]" in repr(SEED.with_(sp_size=2, topology=INTERLEAVED))
    for bad in (((0, 1), (2,)), ((0, 1), (1, 2)), ((2, 1),), ()):
        with pytest.raises(ValueError):
            Topology(bad)


def test_layouts_reach_a_shifted_group_and_interleaved_groups() -> None:
    two = layouts(2, 4)
    assert two[0] == Topology.single(2) and SHIFTED in two and INTERLEAVED in two
    assert Topology(((0, 1), (2, 3))) in two
    assert layouts(3, 4) == [Topology.single(3), Topology(((1, 2, 3),))]
    assert layouts(4, 4) == [Topology.single(4)]
    assert all(t.world <= 4 for sp in (2, 3, 4) for t in layouts(sp, 4))


def test_rank_invariants_draw_topologies_and_shrink_to_the_simplest() -> None:
    cases = CATALOGUE["INV-RANK-001"].cases("packed", load_engine("impl"))
    quick = settings(database=None, max_examples=2000)
    assert find(cases, lambda c: True, settings=quick).topology is None
    for layout in ("shifted", "contiguous", "interleaved"):
        found = find(cases, lambda c: c.topology is not None and c.topology.layout == layout, settings=quick)
        assert found.topology.sp == found.sp_size
    assert find(topologies(4, 4), lambda t: True, settings=quick) is None  # no other layout for sp = 4


@needs_ranks
@pytest.mark.parametrize("topology", [SHIFTED, INTERLEAVED], ids=["shifted", "interleaved"])
def test_impl_on_each_group_equals_its_single_rank_run(topology: Topology) -> None:
    engine = load_engine("impl")
    case = SEED.with_(sp_size=2, topology=topology, calculate_sum_pi_squared=True)
    run = ranks.execute(engine, case)
    assert len(run.groups) == topology.dp and run.groups[0] is run
    for g, group in enumerate(run.groups):
        assert group.case == topology.group_case(case, g)
        single = execute(engine, group.case.with_(sp_size=1))
        ids = group.micro_batch["input_ids"].values()
        rolled = torch.cat([torch.roll(ids, -1), ids.new_zeros(ids.shape[0] % 2)])
        for r in range(2):  # group rank r holds the r-th half, whatever its global rank
            assert torch.equal(group.output_args[r]["input_ids_rmpad_rolled"], rolled.view(2, -1)[r]), (g, r)
            for key in ("log_probs", "entropy", "sum_pi_squared"):
                assert torch.allclose(group.rank_outputs[r][key].values(), single.outputs[key].values(),
                                      atol=1e-5), (g, r, key)
    if topology.dp > 1:  # each group ran its own micro-batch
        assert not torch.equal(run.groups[0].micro_batch["input_ids"].values(),
                               run.groups[1].micro_batch["input_ids"].values())


@needs_ranks
def test_an_error_names_the_global_rank_it_was_raised_on() -> None:
    case = SEED.with_(sp_size=2, use_fused_kernels=True, topology=SHIFTED)  # fused with per-sample temperature
    with pytest.raises(impl.errors.TemperatureError) as info:
        ranks.execute(load_engine("impl"), case)
    assert any("raised on real rank 1" in note for note in getattr(info.value, "__notes__", []))


def test_a_topology_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit sp=3"):
        ranks.execute(load_engine("impl"), SEED.with_(sp_size=3, topology=INTERLEAVED))
    with pytest.raises(ValueError, match="does not fit"):
        ranks.execute(load_engine("impl"), SEED.with_(sp_size=2, topology=Topology(((3, 4),))))


@needs_ranks
@pytest.mark.parametrize("invariant_id", ["INV-RANK-002", "INV-RANK-001"])
def test_global_rank_as_sp_rank_passes_one_group_and_fails_shifted_or_interleaved(invariant_id: str) -> None:
    engine = planted_engine("rank_sp_rank_from_global_rank")
    check = CATALOGUE[invariant_id].check
    case = SEED.with_(sp_size=2)
    check(Ctx(engine, case, "cpu", "packed"))  # quiet on one group [0, sp)
    check(Ctx(engine, case.with_(topology=Topology(((0, 1), (2, 3)))), "cpu", "packed"))  # and on [2k, 2k + 2)
    for topology in (SHIFTED, INTERLEAVED):
        with pytest.raises(AssertionError, match=r"SP group 0 of sp_groups=.*global ranks \[(1, 2|0, 2)\]"):
            check(Ctx(engine, case.with_(topology=topology), "cpu", "packed"))
