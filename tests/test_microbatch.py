"""The micro-batch layer (impl.microbatch): hand-computed examples, errors, no mutation.

No verl needed; tests/test_dropin_microbatch.py compares with verl 0.9.1 where it is importable.
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import impl
from impl import BatchMismatchError, NestedLayoutError, ShapeError, UnsupportedConfigError
from impl.microbatch import balanced_bins


def _offsets(lens):
    return torch.nn.functional.pad(torch.tensor(lens, dtype=torch.int64).cumsum(0), (1, 0))


def _jagged(values, lens, jagged_dim=1):
    return torch.nested.nested_tensor_from_jagged(values, _offsets(lens), jagged_dim=jagged_dim)


def mini_batch(lens, *, seed=0, **flags) -> TensorDict:
    """Ids ``100 * row + t``, mRoPE positions ``(B, 4, j)``, teacher top-2 ``(B, j, 2)``, routed experts
    ``(B, j, 2, 3)``, a dense per-sample score, a per-sample uid stack and a flag."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(total) - _offsets(lens)[:-1][rows]
    td = TensorDict({
        "input_ids": _jagged(100 * rows + pos, lens),
        "position_ids": _jagged(pos.unsqueeze(0) + 1000 * torch.arange(4).unsqueeze(1), lens, jagged_dim=2),
        "teacher_ids": _jagged(torch.randint(0, 50, (total, 2), generator=gen), lens),
        "routed_experts": _jagged(torch.randint(0, 8, (total, 2, 3), generator=gen), lens),
        "score": torch.arange(len(lens), dtype=torch.float32),
        "uid": NonTensorStack.from_list([NonTensorData(f"u{i}") for i in range(len(lens))]),
    }, batch_size=[len(lens)])
    td["calculate_entropy"] = NonTensorData(True)
    for key, value in flags.items():
        td[key] = NonTensorData(value)
    return td


def rows_of(nt: torch.Tensor) -> list[list]:
    """Each row of a jagged tensor as nested lists (compares values and layout)."""
    return [t.tolist() for t in nt.unbind()]


def _torch_pads_jagged() -> bool:
    """Whether this torch has ``to_padded_tensor`` for jagged tensors (torch 2.4 has none: NotImplementedError)."""
    try:
        _jagged(torch.zeros(1), [1]).to_padded_tensor(0)
    except NotImplementedError:
        return False
    return True


TORCH_PADS_JAGGED = _torch_pads_jagged()


def padded_shape(nt: torch.Tensor) -> tuple[int, ...]:
    """The shape ``nt.to_padded_tensor(0)`` has: the ragged dim as long as the cached longest row.

    The cache (``_max_seqlen``, what torch's padding and SDPA read) must hold the true longest row; where
    torch can pad jagged tensors (not torch 2.4), the padded tensor must have that width too.
    """
    longest = max(int(n) for n in nt.offsets().diff().tolist())
    assert nt._max_seqlen == longest, (nt._max_seqlen, longest)
    shape = (*nt.shape[:nt._ragged_idx], longest, *nt.shape[nt._ragged_idx + 1:])
    if TORCH_PADS_JAGGED:
        assert tuple(nt.to_padded_tensor(0).shape) == shape
    return shape


def snapshot(td: TensorDict) -> dict:
    out = {}
    for key, value in td.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[key] = (value.values().clone(), value.offsets().clone(), value._ragged_idx)
        elif isinstance(value, torch.Tensor):
            out[key] = value.clone()
        else:
            out[key] = repr(value.tolist() if hasattr(value, "tolist") else value)
    return out


def assert_unchanged(td: TensorDict, before: dict) -> None:
    after = snapshot(td)
    assert after.keys() == before.keys()
    for key, old in before.items():
        new = after[key]
        if isinstance(old, tuple):
            assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1]) and old[2] == new[2], key
        elif isinstance(old, torch.Tensor):
            assert torch.equal(old, new), key
        else:
            assert old == new, key


def raises(exc, *fragments):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# --------------------------------------------------------------------------- partition arithmetic

def test_workload_ceildiv_roundup():
    assert impl.calculate_workload(torch.tensor([0, 1, 10])).tolist() == [0, 24577, 245860]
    assert [impl.ceildiv(7, 3), impl.ceildiv(6, 3), impl.ceildiv(0, 3)] == [3, 2, 0]
    assert [impl.roundup_divisible(7, 4), impl.roundup_divisible(8, 4)] == [8, 8]


def test_balanced_partitions_reach_the_optimum_on_small_cases():
    # {8, 7} | {6, 5, 4}: both 15, the optimum (total 30 over 2)
    parts = impl.get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]
    assert all(p == sorted(p) and p for p in parts)
    assert max(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == 15
    # one heavy item alone, the rest together: unequal counts are allowed
    parts = impl.get_seqlen_balanced_partitions([10, 1, 1, 8], 2, equal_size=False)
    assert sorted(sorted(p) for p in parts) == [[0], [1, 2, 3]]
    # equal sizes: two items each, sums 9 and 9
    parts = impl.get_seqlen_balanced_partitions([5, 5, 4, 4], 2, equal_size=True)
    assert sorted(len(p) for p in parts) == [2, 2]
    assert sorted(sum([5, 5, 4, 4][i] for i in p) for p in parts) == [9, 9]


def test_balanced_bins_never_empty_and_equal_sizes():
    gen = torch.Generator().manual_seed(3)
    w = impl.calculate_workload(torch.randint(1, 500, (60,), generator=gen))
    for k in (1, 2, 7, 30, 60):
        bins = balanced_bins(w, k)
        assert torch.bincount(bins, minlength=k).min() >= 1
    bins = balanced_bins(w, 6, equal_size=True)
    assert torch.bincount(bins, minlength=6).tolist() == [10] * 6
    with raises(ShapeError, "7", "10"):
        impl.get_seqlen_balanced_partitions(list(range(7)), 10, equal_size=False)
    with raises(ShapeError, "equal"):
        balanced_bins(w, 7, equal_size=True)


# --------------------------------------------------------------------------- rearrange_micro_batches

LENS = [5, 3, 4, 2, 6, 1]  # total 21


def test_rearrange_partitions_within_the_budget():
    td = mini_batch(LENS)
    before = snapshot(td)
    micro, idx = impl.rearrange_micro_batches(td, max_token_len=8)
    assert_unchanged(td, before)
    assert len(micro) == 3 == len(idx)  # ceil(21 / 8); {6, 2}, {5, 3}, {4, 1} fit
    assert sorted(i for p in idx for i in p) == list(range(6))
    for m, p in zip(micro, idx):
        assert p == sorted(p)
        assert sum(LENS[i] for i in p) <= 8
        assert m.batch_size == torch.Size([len(p)])
        assert rows_of(m["input_ids"]) == [[100 * i + t for t in range(LENS[i])] for i in p]
        assert m["position_ids"]._ragged_idx == 2
        assert rows_of(m["position_ids"]) == [[[1000 * c + t for t in range(LENS[i])] for c in range(4)] for i in p]
        assert rows_of(m["teacher_ids"]) == [rows_of(td["teacher_ids"])[i] for i in p]
        assert rows_of(m["routed_experts"]) == [rows_of(td["routed_experts"])[i] for i in p]
        assert m["score"].tolist() == [float(i) for i in p]
        assert m.get("uid").tolist() == [f"u{i}" for i in p]
        assert m["calculate_entropy"] is True


def test_rearrange_orders_micro_batches_like_verl():
    # workloads per micro-batch sorted descending [w0 >= w1 >= w2 >= w3], then evens reversed + odds:
    # [w2, w0, w1, w3]: the heaviest in the middle
    lens = [4, 4, 3, 3, 2, 2, 1, 1]
    micro, idx = impl.rearrange_micro_batches(mini_batch(lens), max_token_len=5)
    loads = [sum(impl.calculate_workload(torch.tensor([lens[i] for i in p])).tolist()) for p in idx]
    ranked = sorted(loads, reverse=True)
    assert loads == ranked[::2][::-1] + ranked[1::2]
    _, plain = impl.rearrange_micro_batches(mini_batch(lens), max_token_len=5, use_dynamic_bsz_balance=False)
    assert sorted(map(tuple, plain)) == sorted(map(tuple, idx))


def test_rearrange_groups_divisor_and_minimum():
    td = mini_batch(LENS)
    _, idx = impl.rearrange_micro_batches(td, max_token_len=9, force_group_size=2)
    assert all(len(p) % 2 == 0 and all(p[j + 1] == p[j] + 1 and p[j] % 2 == 0 for j in range(0, len(p), 2))
               for p in idx)  # groups (0,1), (2,3), (4,5) together: 8, 6, 7 tokens
    _, idx = impl.rearrange_micro_batches(td, max_token_len=8, num_batches_divided_by=2)
    assert len(idx) == 4  # 3 rounded up to a multiple of 2
    _, idx = impl.rearrange_micro_batches(td, max_token_len=100, min_num_micro_batch=5)
    assert len(idx) == 5 and all(idx)
    with raises(ShapeError, "7 non-empty micro-batches", "6 groups"):
        impl.rearrange_micro_batches(td, max_token_len=100, min_num_micro_batch=7)
    with raises(ShapeError, "divisible by force_group_size 4"):
        impl.rearrange_micro_batches(td, max_token_len=100, force_group_size=4)
    with raises(ShapeError, "group", "max_token_len=7"):
        impl.rearrange_micro_batches(td, max_token_len=7, force_group_size=2)


def test_rearrange_raises_the_count_until_every_micro_batch_fits():
    # total 12 over a budget of 6 gives 2, but {5}, {4, 3} is over: 3 micro-batches
    lens = [5, 4, 3]
    _, idx = impl.rearrange_micro_batches(mini_batch(lens), max_token_len=6)
    assert len(idx) == 3
    # with a step of 2: 2 does not fit, 4 is more micro-batches than samples
    with raises(ShapeError, "4 non-empty micro-batches", "only 3 groups"):
        impl.rearrange_micro_batches(mini_batch(lens), max_token_len=6, num_batches_divided_by=2)


def test_a_sample_over_the_budget_is_refused():
    with raises(ShapeError, "max_token_len=5", "'input_ids' row 4", "6 tokens"):
        impl.rearrange_micro_batches(mini_batch(LENS), max_token_len=5)


def test_dense_batches_count_the_attention_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    td = TensorDict({"input_ids": torch.arange(16).view(4, 4), "attention_mask": mask}, batch_size=[4])
    micro, idx = impl.rearrange_micro_batches(td, max_token_len=5)  # 10 tokens: 2 micro-batches
    assert len(idx) == 2 and all(mask[p].sum() <= 5 for p in idx)
    assert torch.equal(torch.cat([m["input_ids"] for m in micro]), td["input_ids"][sum(idx, [])])
    with raises(ShapeError, "max_token_len=3", "4 tokens"):  # as verl: the padded width counts
        impl.rearrange_micro_batches(td, max_token_len=3)


# --------------------------------------------------------------------------- prepare_micro_batches

def test_prepare_dynamic_multiplies_the_budget_by_sp_size():
    td = mini_batch(LENS, use_dynamic_bsz=True, max_token_len_per_gpu=4, sp_size=2)
    micro, idx = impl.prepare_micro_batches(td)
    _, expected = impl.rearrange_micro_batches(mini_batch(LENS), max_token_len=8)
    assert idx == expected and len(micro) == 3
    with raises(UnsupportedConfigError, "max_token_len_per_gpu"):
        impl.prepare_micro_batches(mini_batch(LENS))


def test_prepare_fixed_size_chunks_in_order():
    td = mini_batch([3, 1, 4, 1, 5, 9, 2, 6], use_dynamic_bsz=False, micro_batch_size_per_gpu=2)
    micro, idx = impl.prepare_micro_batches(td)
    assert idx is None and len(micro) == 4
    assert [rows_of(m["input_ids"]) for m in micro] == [rows_of(td["input_ids"])[i:i + 2] for i in (0, 2, 4, 6)]
    assert all(m["position_ids"]._ragged_idx == 2 for m in micro)
    grouped = mini_batch([3, 1, 4, 1, 5, 9, 2, 6], use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         force_group_size=2)
    assert [len(m) for m in impl.prepare_micro_batches(grouped)[0]] == [4, 4]
    bad = mini_batch(LENS, use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
    with raises(ShapeError, "data size 6", "1 * 4"):
        impl.prepare_micro_batches(bad)


# --------------------------------------------------------------------------- restore / postprocess

def test_restore_dynamic_batch_inverts_the_concatenation():
    idx = [[2, 0], [3], [1, 4]]
    order = [2, 0, 3, 1, 4]
    dense = torch.tensor([20.0, 0.0, 30.0, 10.0, 40.0])  # rows in micro-batch order
    assert impl.restore_dynamic_batch(dense, idx).tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    lens = [2, 3, 1, 2, 2]  # lengths in micro-batch order
    values = torch.cat([torch.full((n,), float(r)) for n, r in zip(lens, order)])
    restored = impl.restore_dynamic_batch(_jagged(values, lens), idx)
    assert rows_of(restored) == [[float(r)] * lens[order.index(r)] for r in range(5)]
    assert impl.get_reverse_idx([2, 0, 1]) == [1, 2, 0]
    with raises(ShapeError, "4 indices", "batch size 5"):
        impl.restore_dynamic_batch(dense, [[0, 1], [2, 3]])
    with raises(ShapeError, "not a permutation"):
        impl.restore_dynamic_batch(dense, [[0, 1], [1, 3, 4]])


def test_restore_keeps_3d_equal_length_outputs_ragged_at_2():
    for batch in (1, 3):  # B = 1 and equal lengths: verl's as_nested_tensor rebuild turns these ragged at 1
        pos = _jagged(torch.arange(4 * 2 * batch).view(4, 2 * batch), [2] * batch, jagged_dim=2)
        idx = [[batch - 1 - i] for i in range(batch)]
        out = impl.restore_dynamic_batch(pos, idx)
        assert out._ragged_idx == 2 and out.shape[:2] == (batch, 4)
        assert rows_of(out) == rows_of(pos)[::-1]
        assert padded_shape(out) == (batch, 4, 2)


def test_postprocess_restores_each_samples_outputs():
    td = mini_batch(LENS, use_dynamic_bsz=True, max_token_len_per_gpu=8)
    micro, idx = impl.prepare_micro_batches(td)
    outputs = [{"model_output": {"log_probs": m["input_ids"].clone(), "score": m["score"] * 2},
                "loss": torch.tensor(float(i)), "metrics": {"n": len(m), "both": [1, 2]}}
               for i, m in enumerate(micro)]
    got = impl.postprocess_batch_func(outputs, idx, td)
    assert rows_of(got["model_output"]["log_probs"]) == rows_of(td["input_ids"])
    assert got["model_output"]["score"].tolist() == [2.0 * i for i in range(6)]
    assert [float(x) for x in got["loss"]] == [0.0, 1.0, 2.0]
    assert got["metrics"] == {"n": [len(m) for m in micro], "both": [1, 2] * 3}
    td["pad_mode"] = NonTensorData("right")
    with raises(UnsupportedConfigError, "no_padding", "right"):
        impl.postprocess_batch_func(outputs, idx, td)


# --------------------------------------------------------------------------- tensordict utilities

def test_index_select_chunk_concat_round_trip_every_layout():
    td = mini_batch([3, 3, 3, 3])  # equal lengths: every nested key keeps its layout
    before = snapshot(td)
    parts = impl.chunk_tensordict(td, 2)
    assert [len(p) for p in parts] == [2, 2]
    assert parts[0]["position_ids"]._ragged_idx == 2 and parts[1]["teacher_ids"]._ragged_idx == 1
    back = impl.concat_tensordict(parts)
    for key in ("input_ids", "position_ids", "teacher_ids", "routed_experts"):
        assert rows_of(back[key]) == rows_of(td[key]), key
        assert back[key]._ragged_idx == td[key]._ragged_idx
    assert back.get("uid").tolist() == ["u0", "u1", "u2", "u3"] and back["calculate_entropy"] is True
    sel = impl.index_select_tensor_dict(td, [-1, 0])
    assert rows_of(sel["input_ids"]) == [rows_of(td["input_ids"])[3], rows_of(td["input_ids"])[0]]
    assert padded_shape(sel["position_ids"]) == (2, 4, 3)
    one = impl.index_select_tensor_dict(td, torch.tensor([2]))
    assert one["position_ids"]._ragged_idx == 2 and rows_of(one["position_ids"]) == [rows_of(td["position_ids"])[2]]
    assert impl.index_select_tensor_dict(None, [0]) is None
    assert_unchanged(td, before)


def test_tensordict_utility_errors_name_the_problem():
    td = mini_batch(LENS)
    with raises(ShapeError, "6 samples", "4 equal chunks"):
        impl.chunk_tensordict(td, 4)
    with raises(ShapeError, "[-7, 0]", "size 6"):
        impl.index_select_tensor_dict(td, [0, -7])
    a, b = impl.chunk_tensordict(td, 2)
    del b["teacher_ids"]
    with raises(BatchMismatchError, "data[1]", "teacher_ids"):
        impl.concat_tensordict([a, b])
    with raises(BatchMismatchError, "ragged at dim 2", "ragged at dim 1"):
        impl.concat_nested_tensors([td["teacher_ids"], td["position_ids"]])


def test_nested_tensor_from_tensor_list_caches_the_longest_row():
    samples = [torch.ones(2, 5), torch.ones(2, 7)]  # ragged at the last dim, values (2, 12)
    nt = impl.nested_tensor_from_tensor_list(samples, ragged_idx=2)
    assert nt._ragged_idx == 2 and padded_shape(nt) == (2, 2, 7)  # verl: (2, 2, 2), truncated
    assert rows_of(nt) == [s.tolist() for s in samples]
    with raises(ShapeError, "sample 1", "(3, 7)"):
        impl.nested_tensor_from_tensor_list([torch.ones(2, 5), torch.ones(3, 7)], ragged_idx=2)
    with raises(ShapeError, "empty"):
        impl.nested_tensor_from_tensor_list([])


def test_list_of_dict_to_tensordict_keeps_ragged_keys_nested():
    samples = [{"input_ids": torch.tensor([1, 2, 3]), "position_ids": torch.arange(12).view(4, 3),
                "teacher_ids": torch.zeros(3, 2, dtype=torch.long), "reward": torch.tensor(1.0), "uid": "a"}
               for _ in range(2)]  # equal lengths: verl stacks every key into a dense tensor
    td = impl.list_of_dict_to_tensordict(samples)
    assert td["input_ids"].is_nested and td["input_ids"].offsets().tolist() == [0, 3, 6]
    assert td["position_ids"]._ragged_idx == 2 and td["position_ids"].offsets().tolist() == [0, 3, 6]
    assert td["teacher_ids"]._ragged_idx == 1 and td["teacher_ids"].values().shape == (6, 2)
    assert not td["reward"].is_nested and td["reward"].tolist() == [1.0, 1.0]
    assert td.get("uid").tolist() == ["a", "a"]
    one = impl.list_of_dict_to_tensordict(samples[:1])
    assert one["input_ids"].offsets().tolist() == [0, 3]
    ragged = impl.list_of_dict_to_tensordict([{"t": torch.zeros(3, 2)}, {"t": torch.zeros(5, 2)}])
    assert ragged["t"]._ragged_idx == 1 and ragged["t"].offsets().tolist() == [0, 3, 8]
    with raises(ShapeError, "'t'", "more than one dim"):
        impl.list_of_dict_to_tensordict([{"t": torch.zeros(3, 2)}, {"t": torch.zeros(5, 4)}])
    with raises(BatchMismatchError, "sample 1"):
        impl.list_of_dict_to_tensordict([{"a": 1}, {"b": 2}])


def test_maybe_fix_3d_position_ids_rebuilds_the_equal_length_misread():
    per_sample = [torch.arange(8).view(4, 2) + 10 * i for i in range(3)]
    misread = torch.nested.as_nested_tensor(per_sample, layout=torch.jagged)  # ragged at 1: values (12, 2)
    assert misread._ragged_idx == 1
    td = TensorDict({"position_ids": misread}, batch_size=[3])
    out = impl.maybe_fix_3d_position_ids(td)
    assert out is td and misread._ragged_idx == 1  # the old tensor object is untouched
    fixed = td["position_ids"]
    assert fixed._ragged_idx == 2 and fixed.offsets().tolist() == [0, 2, 4, 6]
    assert rows_of(fixed) == [p.tolist() for p in per_sample]
    canonical = _jagged(torch.arange(20).view(4, 5), [2, 3], jagged_dim=2)
    td = TensorDict({"position_ids": canonical}, batch_size=[2])
    impl.maybe_fix_3d_position_ids(td)
    assert td["position_ids"] is canonical


# --------------------------------------------------------------------------- data-parallel count

def _dp_worker(rank: int, path: str, lens: list[list[int]], result_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        _, idx = impl.rearrange_micro_batches(mini_batch(lens[rank]), max_token_len=8, dp_group=dist.group.WORLD)
        _, alone = impl.rearrange_micro_batches(mini_batch(lens[rank]), max_token_len=8, dp_group=None)
        with open(os.path.join(result_dir, f"{rank}"), "w") as f:
            f.write(f"{len(idx)} {len(alone)}")
    finally:
        dist.destroy_process_group()


def test_same_micro_num_in_dp_takes_the_maximum_over_ranks():
    import torch.multiprocessing as mp

    lens = [[4, 4, 4, 4], [8, 8, 8, 1, 1]]  # alone: 2 and 4 micro-batches
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_dp_worker, args=(os.path.join(tmp, "store"), lens, tmp), nprocs=2, start_method="spawn")
        got = [open(os.path.join(tmp, str(r))).read().split() for r in range(2)]
    assert got == [["4", "2"], ["4", "4"]]


def test_gathers_in_blocks_and_with_empty_rows(monkeypatch):
    from impl.microbatch import nested

    lens = [3, 0, 5, 2, 0, 4, 1]
    td = mini_batch(lens)
    idx = [6, 4, 2, 0, 1, 5, 3]
    expect = {key: [rows_of(td[key])[i] for i in idx] for key in ("input_ids", "position_ids", "routed_experts")}
    assert nested.token_index(torch.tensor([5, 0, 9]), torch.tensor([2, 0, 3]), torch.tensor([0, 2, 2, 5]), 5,
                              torch.int64).tolist() == [5, 6, 9, 10, 11]
    for block in (1 << 20, 4, 1):  # one gather; blocks of about 4 tokens; one row at a time
        monkeypatch.setattr(nested, "BLOCK_TOKENS", block)
        sel = impl.index_select_tensor_dict(td, idx)
        for key, rows in expect.items():
            assert rows_of(sel[key]) == rows, (block, key)
        assert sel["position_ids"]._ragged_idx == 2


# --------------------------------------------------------------------------- the torch floor (2.4)

REAL_FACTORY = torch.nested.nested_tensor_from_jagged


def _factory_of_torch_24(values, offsets=None, lengths=None, jagged_dim=None):
    """torch 2.4.0's ``nested_tensor_from_jagged``: no ``min_seqlen`` / ``max_seqlen`` keywords."""
    return REAL_FACTORY(values, offsets, lengths, jagged_dim)


def test_the_factory_keywords_are_detected_for_this_torch():
    from impl.microbatch import nested

    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    assert nested.FACTORY_TAKES_SEQLENS == (version >= (2, 5)), torch.__version__


def test_the_torch_24_path_builds_every_tensor_through_the_old_factory(monkeypatch):
    """On any torch: the layer as it runs on torch 2.4, where the factory lacks the length keywords (the
    regression of issue 39: every micro-batch call raised TypeError there). Rows, layout and cached lengths
    as on the fast path; a tensor that requires grad keeps its graph."""
    from impl.microbatch import nested

    td = mini_batch(LENS, use_dynamic_bsz=True, max_token_len_per_gpu=8)
    expect, _ = impl.prepare_micro_batches(td)
    monkeypatch.setattr(torch.nested, "nested_tensor_from_jagged", _factory_of_torch_24)
    monkeypatch.setattr(nested, "FACTORY_TAKES_SEQLENS", False)  # what the import finds on torch 2.4
    monkeypatch.setattr(nested, "_JaggedTensor", None)  # every tensor through the public factory
    micro, idx = impl.prepare_micro_batches(td)
    assert len(micro) == len(expect)
    for got, want in zip(micro, expect):
        for key in ("input_ids", "position_ids", "teacher_ids", "routed_experts"):
            assert rows_of(got[key]) == rows_of(want[key]) and got[key]._ragged_idx == want[key]._ragged_idx, key
            padded_shape(got[key])
    back = impl.restore_dynamic_batch(impl.concat_nested_tensors([m["input_ids"] for m in micro]), idx)
    assert rows_of(back) == rows_of(td["input_ids"])
    values = torch.arange(12.0).view(2, 6).requires_grad_()
    nt = impl.nested_tensor_from_tensor_list([values[:, :2], values[:, 2:]], ragged_idx=2)
    assert padded_shape(nt) == (2, 2, 4)
    sel = nested.take_rows(nt, torch.tensor([1]), "x")
    assert rows_of(sel) == [values[:, 2:].tolist()] and padded_shape(sel) == (1, 2, 4)
    sel.values().sum().backward()
    assert values.grad.tolist() == [[0, 0, 1, 1, 1, 1]] * 2


def test_fit_budget_exchanges_until_every_set_fits():
    from impl.microbatch.partition import fit_budget

    tokens = torch.tensor([6, 4, 5, 5])
    bins = torch.tensor([0, 0, 0, 1])  # 15 and 5 tokens: over a budget of 10
    assert fit_budget(tokens, impl.calculate_workload(tokens), bins, 2, 10)
    loads = torch.zeros(2, dtype=torch.int64).index_add_(0, bins, tokens)
    assert loads.tolist() == [10, 10] and torch.bincount(bins, minlength=2).min() >= 1
    assert not fit_budget(torch.tensor([6, 6, 6]), impl.calculate_workload(torch.tensor([6, 6, 6])),
                          torch.tensor([0, 0, 1]), 2, 10)  # 18 tokens cannot fit two sets of 10 with 6s
