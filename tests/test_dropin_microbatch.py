"""impl's micro-batch layer as a drop-in for verl 0.9.1's, compared in the same process.

Where verl is right, impl returns verl's result bit for bit (values, offsets, ragged dim, dense
tensors, non-tensor items); the balanced partition may differ (impl does not run
Karmarkar-Karp), so there the test checks verl's contract (every sample once, the budget,
verl's micro-batch order) and that impl balances at least as well by verl's own measure (the
largest micro-batch workload) with no more micro-batches. Where verl is wrong (#7661, #7586,
#7899, a restore list that is not a permutation) the test shows verl's wrong result and
impl's right one (docs/verl-differences.md). Run in verl's environment:

    python -m pytest tests/test_dropin_microbatch.py

Without verl the module skips.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import impl

try:  # verl pins tensordict<=0.10: it lives in its own environment
    from verl.utils import seqlen_balancing as verl_sb
    from verl.utils import tensordict_utils as verl_tu
    from verl.workers.engine import utils as verl_eu
except Exception:  # noqa: BLE001 - any import failure means "no verl here"
    verl_sb = verl_tu = verl_eu = None

pytestmark = pytest.mark.skipif(verl_tu is None, reason="verl is not importable (run in the verl env)")

NESTED = ("input_ids", "position_ids", "responses", "teacher_ids", "routed_experts")


def _offsets(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0))


def rollout_lengths(kind: str, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) lengths as RL rollouts have them."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 65, (batch,), generator=gen)
    if kind == "uniform":
        response = torch.randint(1, 513, (batch,), generator=gen)
    elif kind == "short_and_max":  # many short, a few at the maximum
        response = torch.where(torch.rand(batch, generator=gen) < 0.15, 512, torch.randint(1, 64, (batch,),
                                                                                            generator=gen))
    elif kind == "all_max":  # every response hit the maximum, equal prompts: equal lengths
        prompt, response = torch.full((batch,), 32), torch.full((batch,), 512)
    elif kind == "groups":  # GRPO groups of 4 sharing a prompt
        prompt = prompt[::4].repeat_interleave(4)[:batch]
        response = torch.randint(1, 513, (batch,), generator=gen)
    else:
        raise ValueError(kind)
    return prompt, response


def mini_batch(kind: str, batch: int, seed: int = 0) -> TensorDict:
    prompt, response = rollout_lengths(kind, batch, seed)
    lens = prompt + response
    total = int(lens.sum())
    gen = torch.Generator().manual_seed(seed + 1)
    off, roff = _offsets(lens), _offsets(response)

    def nested(values, at=off, jagged_dim=1):
        return torch.nested.nested_tensor_from_jagged(values, at, jagged_dim=jagged_dim)

    td = TensorDict({
        "input_ids": nested(torch.randint(0, 32000, (total,), generator=gen)),
        "position_ids": nested(torch.randint(0, 4096, (4, total), generator=gen), jagged_dim=2),
        "responses": nested(torch.randint(0, 32000, (int(response.sum()),), generator=gen), roff),
        "teacher_ids": nested(torch.randint(0, 32000, (total, 3), generator=gen)),
        "routed_experts": nested(torch.randint(0, 64, (total, 2, 4), generator=gen).to(torch.uint8)),
        "advantages": torch.randn(batch, generator=gen),
        "uid": NonTensorStack.from_list([NonTensorData(f"u{i // 4}") for i in range(batch)]),
    }, batch_size=[batch])
    td["temperature"] = NonTensorData(0.7)
    return td


CASES = [("uniform", 64, 0), ("short_and_max", 64, 1), ("all_max", 16, 2), ("groups", 64, 3), ("uniform", 1, 4),
         ("uniform", 256, 5), ("short_and_max", 256, 6)]
CASE_IDS = [f"{k}-B{b}" for k, b, _ in CASES]


def assert_same(a, b, key: str) -> None:
    """Bit for bit: values, offsets and ragged dim of nested tensors; dense tensors; non-tensor items."""
    if isinstance(a, torch.Tensor) and a.is_nested:
        assert isinstance(b, torch.Tensor) and b.is_nested, key
        assert a.values().dtype == b.values().dtype and torch.equal(a.values(), b.values()), key
        assert torch.equal(a.offsets(), b.offsets()), key
        assert a._ragged_idx == b._ragged_idx, key
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), key
    elif hasattr(a, "tolist"):
        assert a.tolist() == b.tolist(), key
    else:
        assert a == b, key


def assert_same_td(a: TensorDict, b: TensorDict) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    assert a.batch_size == b.batch_size
    for key in a.keys():
        assert_same(a[key], b[key], key)


# --------------------------------------------------------------------------- where verl is right: bit for bit

@pytest.mark.parametrize("kind,batch,seed", CASES, ids=CASE_IDS)
def test_index_select_chunk_concat_match_verl(kind, batch, seed):
    td = mini_batch(kind, batch, seed)
    gen = torch.Generator().manual_seed(seed)
    for idx in (torch.randperm(batch, generator=gen), torch.randperm(batch, generator=gen)[: max(1, batch // 3)]):
        assert_same_td(impl.index_select_tensor_dict(td, idx), verl_tu.index_select_tensor_dict(td, idx))
        assert_same_td(impl.index_select_tensor_dict(td, idx.tolist()), verl_tu.index_select_tensor_dict(td, idx))
    for chunks in {1, batch} | ({4} if batch % 4 == 0 else set()):
        mine, theirs = impl.chunk_tensordict(td, chunks), verl_tu.chunk_tensordict(td, chunks)
        assert len(mine) == len(theirs) == chunks
        for a, b in zip(mine, theirs):
            assert_same_td(a, b)
        assert_same_td(impl.concat_tensordict(mine), verl_tu.concat_tensordict(theirs))
        for key in NESTED:
            assert_same(impl.concat_nested_tensors([p[key] for p in mine]),
                        verl_tu.concat_nested_tensors([p[key] for p in theirs]), key)


@pytest.mark.parametrize("kind,batch,seed", CASES, ids=CASE_IDS)
def test_restore_and_postprocess_match_verl(kind, batch, seed):
    td = mini_batch(kind, batch, seed)
    gen = torch.Generator().manual_seed(seed + 9)
    perm = torch.randperm(batch, generator=gen).tolist()
    cuts = sorted(set(torch.randint(1, max(batch, 2), (3,), generator=gen).tolist()) - {batch})
    idx = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, batch]) if perm[a:b]]
    flat = sum(idx, [])
    for key in ("input_ids", "teacher_ids", "routed_experts"):  # 2-D rows of each sample rebuild fine in verl
        concatenated = impl.index_select_tensor_dict(td, flat)[key]
        assert_same(impl.restore_dynamic_batch(concatenated, idx), verl_sb.restore_dynamic_batch(concatenated, idx),
                    key)
    dense = td["advantages"][flat]
    assert_same(impl.restore_dynamic_batch(dense, idx), verl_sb.restore_dynamic_batch(dense, idx), "advantages")
    assert impl.get_reverse_idx(flat) == verl_sb.get_reverse_idx(flat)
    micro = [impl.index_select_tensor_dict(td, p) for p in idx]
    outputs = [{"model_output": {"log_probs": m["input_ids"].clone(), "entropy": m["responses"].clone()},
                "loss": torch.tensor(float(i)), "metrics": {"n": len(m)}} for i, m in enumerate(micro)]
    flags = TensorDict({}, batch_size=[])
    flags["use_dynamic_bsz"] = NonTensorData(True)
    mine, theirs = impl.postprocess_batch_func(outputs, idx, flags), verl_eu.postprocess_batch_func(outputs, idx, flags)
    for key in ("log_probs", "entropy"):
        assert_same(mine["model_output"][key], theirs["model_output"][key], key)
    assert mine["loss"] == theirs["loss"] and mine["metrics"] == theirs["metrics"]


@pytest.mark.parametrize("kind,batch,seed", [c for c in CASES if c[1] % 4 == 0], ids=[i for c, i in zip(CASES, CASE_IDS)
                                                                                    if c[1] % 4 == 0])
def test_fixed_size_micro_batches_match_verl(kind, batch, seed):
    td = mini_batch(kind, batch, seed)
    td["use_dynamic_bsz"] = NonTensorData(False)
    td["micro_batch_size_per_gpu"] = NonTensorData(2)
    td["force_group_size"] = NonTensorData(2)
    mine, mine_idx = impl.prepare_micro_batches(td)
    theirs, theirs_idx = verl_eu.prepare_micro_batches(td)
    assert mine_idx is None and theirs_idx is None and len(mine) == len(theirs) == batch // 4
    for a, b in zip(mine, theirs):
        assert_same_td(a, b)


def test_small_helpers_match_verl():
    lens = torch.tensor([0, 1, 7, 4096, 32768])
    assert torch.equal(impl.calculate_workload(lens), verl_sb.calculate_workload(lens))
    for a in range(0, 20):
        for b in (1, 3, 8):
            assert impl.ceildiv(a, b) == verl_sb.ceildiv(a, b)
            assert impl.roundup_divisible(a, b) == verl_sb.roundup_divisible(a, b)
    rows = [torch.arange(n * 3).view(n, 3) for n in (2, 5, 1)]  # ragged at 1, (j, K) samples
    assert_same(impl.nested_tensor_from_tensor_list(rows, ragged_idx=1),
                verl_tu.nested_tensor_from_tensor_list(rows, ragged_idx=1), "rows")
    flat = [torch.arange(n) for n in (3, 1, 4)]
    assert_same(impl.nested_tensor_from_tensor_list(flat), verl_tu.nested_tensor_from_tensor_list(flat), "flat")
    ragged = [{"ids": torch.arange(n), "uid": f"u{n}"} for n in (3, 1, 4)]
    assert_same_td(impl.list_of_dict_to_tensordict(ragged), verl_tu.list_of_dict_to_tensordict(ragged))


# --------------------------------------------------------------------------- the balanced partition

def _max_workload(lens: torch.Tensor, parts: list[list[int]]) -> int:
    w = verl_sb.calculate_workload(lens)
    return max(int(w[p].sum()) for p in parts)


BUDGETS = [(kind, batch, seed, budget) for kind, batch, seed in CASES for budget in (1024, 2048, 8192)
           if batch > 1 or budget == 1024]


@pytest.mark.parametrize("kind,batch,seed,budget", BUDGETS, ids=[f"{k}-B{b}-T{t}" for k, b, _, t in BUDGETS])
def test_rearrange_balances_at_least_as_well_as_verl(kind, batch, seed, budget):
    td = mini_batch(kind, batch, seed)
    lens = td["input_ids"].offsets().diff()
    mine, mine_idx = impl.rearrange_micro_batches(td, max_token_len=budget)
    theirs, theirs_idx = verl_sb.rearrange_micro_batches(td, max_token_len=budget)
    assert sorted(sum(mine_idx, [])) == list(range(batch))
    assert all(p == sorted(p) and p for p in mine_idx)
    assert all(int(lens[p].sum()) <= budget for p in mine_idx)
    assert len(mine_idx) <= len(theirs_idx)
    if len(mine_idx) == len(theirs_idx):
        assert _max_workload(lens, mine_idx) <= _max_workload(lens, theirs_idx)
    w = verl_sb.calculate_workload(lens)
    loads = [int(w[p].sum()) for p in mine_idx]
    ranked = sorted(loads, reverse=True)  # verl's order: evens reversed, then odds
    assert loads == ranked[::2][::-1] + ranked[1::2]
    for micro, part in zip(mine, mine_idx):  # each micro-batch is verl's selection of its rows
        assert_same_td(micro, verl_tu.index_select_tensor_dict(td, part))


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_and_divided_counts_match_verl(group):
    td = mini_batch("groups", 64, 11)
    for kwargs in ({}, {"num_batches_divided_by": 3}, {"min_num_micro_batch": 9}):
        mine = impl.rearrange_micro_batches(td, max_token_len=4096, force_group_size=group, **kwargs)[1]
        theirs = verl_sb.rearrange_micro_batches(td, max_token_len=4096, force_group_size=group, **kwargs)[1]
        assert len(mine) <= len(theirs)
        assert all(p[j:j + group] == list(range(p[j], p[j] + group)) and p[j] % group == 0
                   for p in mine for j in range(0, len(p), group))


def test_get_seqlen_balanced_partitions_matches_verls_contract():
    gen = torch.Generator().manual_seed(5)
    for n, k, equal in ((40, 4, True), (40, 7, False), (200, 16, False), (96, 12, True)):
        values = torch.randint(1, 10_000, (n,), generator=gen).tolist()
        mine = impl.get_seqlen_balanced_partitions(values, k, equal)
        theirs = verl_sb.get_seqlen_balanced_partitions(values, k, equal)
        assert sorted(sum(mine, [])) == list(range(n)) and all(p == sorted(p) and p for p in mine)
        if equal:
            assert {len(p) for p in mine} == {n // k}
        assert max(sum(values[i] for i in p) for p in mine) <= max(sum(values[i] for i in p) for p in theirs)


def test_dynamic_prepare_uses_the_same_budget_and_count_as_verl():
    td = mini_batch("uniform", 64, 13)
    td["use_dynamic_bsz"] = NonTensorData(True)
    td["max_token_len_per_gpu"] = NonTensorData(1024)
    td["sp_size"] = NonTensorData(2)
    mine, mine_idx = impl.prepare_micro_batches(td)
    theirs, theirs_idx = verl_eu.prepare_micro_batches(td)
    assert len(mine_idx) == len(theirs_idx)
    lens = td["input_ids"].offsets().diff()
    assert all(int(lens[p].sum()) <= 2048 for p in mine_idx)


# --------------------------------------------------------------------------- where verl is wrong

def test_verl_7661_equal_lengths_are_stacked_dense():
    samples = [{"responses": torch.arange(512)} for _ in range(4)]  # a GRPO group all at the maximum
    theirs = verl_tu.list_of_dict_to_tensordict(samples)
    assert not theirs["responses"].is_nested  # verl: a dense (4, 512) tensor, .offsets() fails downstream
    with pytest.raises(AttributeError):
        theirs["responses"].offsets()
    mine = impl.list_of_dict_to_tensordict(samples)
    assert mine["responses"].is_nested and mine["responses"].offsets().tolist() == [0, 512, 1024, 1536, 2048]


def test_verl_7586_rebuilt_nested_tensor_truncates_when_ragged_last():
    samples = [torch.ones(2, 5), torch.ones(2, 7)]
    theirs = verl_tu.nested_tensor_from_tensor_list(samples, ragged_idx=2)
    assert theirs.to_padded_tensor(0).shape[-1] == 2  # padded to values.size(0): the tail is gone
    mine = impl.nested_tensor_from_tensor_list(samples, ragged_idx=2)
    padded = mine.to_padded_tensor(0)
    assert padded.shape == (2, 2, 7) and padded.sum() == 24


@pytest.mark.parametrize("batch", [1, 3])
def test_verl_7899_equal_length_mrope_outputs_turn_ragged_at_1(batch):
    pos = torch.nested.nested_tensor_from_jagged(torch.arange(4 * 6 * batch).view(4, 6 * batch),
                                                 torch.arange(batch + 1) * 6, jagged_dim=2)
    idx = [[i] for i in reversed(range(batch))]
    theirs = verl_sb.restore_dynamic_batch(pos, idx)  # as_nested_tensor of (4, 6) rows: ragged at 1
    assert theirs._ragged_idx == 1 and theirs.offsets().tolist() == [4 * i for i in range(batch + 1)]
    td = TensorDict({"position_ids": theirs}, batch_size=[batch])
    verl_tu.maybe_fix_3d_position_ids(td)  # sets ragged 2 on the ragged-at-1 layout
    with pytest.raises(RuntimeError):
        td["position_ids"].unbind()
    mine = impl.restore_dynamic_batch(pos, idx)
    assert mine._ragged_idx == 2 and [t.tolist() for t in mine.unbind()] == [t.tolist() for t in pos.unbind()][::-1]
    fixed = TensorDict({"position_ids": verl_sb.restore_dynamic_batch(pos, idx)}, batch_size=[batch])
    impl.maybe_fix_3d_position_ids(fixed)  # impl repairs verl's ragged-at-1 result
    assert [t.tolist() for t in fixed["position_ids"].unbind()] == [t.tolist() for t in mine.unbind()]


def test_verl_restores_a_non_permutation_silently():
    data = torch.tensor([10.0, 11.0, 12.0])
    got = verl_sb.restore_dynamic_batch(data, [[0, 0], [2]])  # row 1 never produced: verl returns something
    assert got.shape == (3,)
    with pytest.raises(impl.ShapeError, match="not a permutation"):
        impl.restore_dynamic_batch(data, [[0, 0], [2]])


def test_signatures_are_verls():
    import inspect

    names = {verl_eu: ["prepare_micro_batches", "postprocess_batch_func"],
             verl_sb: ["rearrange_micro_batches", "restore_dynamic_batch", "get_seqlen_balanced_partitions",
                       "get_reverse_idx", "calculate_workload", "ceildiv", "roundup_divisible"],
             verl_tu: ["chunk_tensordict", "concat_tensordict", "index_select_tensor_dict", "concat_nested_tensors",
                       "nested_tensor_from_tensor_list", "list_of_dict_to_tensordict", "maybe_fix_3d_position_ids"]}
    for module, functions in names.items():
        for name in functions:
            theirs = [(p.name, p.default, p.kind) for p in inspect.signature(getattr(module, name)).parameters.values()]
            mine = [(p.name, p.default, p.kind) for p in inspect.signature(getattr(impl, name)).parameters.values()
                    if p.kind != inspect.Parameter.KEYWORD_ONLY]  # impl's additions are keyword-only
            assert mine == theirs, name
