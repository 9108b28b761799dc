"""Worked examples: every public function of impl on tiny inputs, expectations computed by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import impl
from spec.execute.harness import ThreadedAllGather
from spec.planted import LossMaskAttention
from tests.batches import lengths_batch, seed_batch

NAN = float("nan")


def lsm(row: list[float], k: int) -> float:
    """log_softmax(row)[k], by hand."""
    return row[k] - math.log(sum(math.exp(x) for x in row))


# --- the attention mask (seed #6345) -------------------------------------------------------

def test_mask_from_full_lengths_not_loss_mask() -> None:
    mb = seed_batch(use_remove_padding=False)
    mi, _ = impl.LMHeadEngine().prepare_model_inputs(mb)
    assert mi["attention_mask"].dtype == torch.int32
    assert mi["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    old, _ = LossMaskAttention().prepare_model_inputs(mb)  # verl before PR #6345
    assert old["attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]


def test_build_attention_mask_helper() -> None:
    ids = seed_batch()["input_ids"]
    assert impl.build_attention_mask_from_nested(ids).tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert impl.build_attention_mask_from_nested(ids, max_seq_len=6).tolist() == [[1] * 5 + [0], [1, 1, 1, 0, 0, 0]]


# --- prepare_model_inputs ----------------------------------------------------------------------

def test_packed_inputs() -> None:
    mb = seed_batch(temperature=torch.tensor([0.5, 2.0]))
    mi, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    assert mi["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert mi["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert mi["attention_mask"] is None
    assert oa["input_ids_rmpad_rolled"].tolist() == [2, 3, 4, 5, 6, 7, 8, 1]
    assert oa["temperature_rmpad"].tolist() == [0.5] * 5 + [2.0] * 3
    assert oa["pad_size"] == 0


def test_padded_inputs() -> None:
    mb = seed_batch(use_remove_padding=False, pad_token_id=9, temperature=torch.tensor([0.5, 2.0]))
    mi, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    assert mi["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 9]]
    assert mi["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert oa["input_ids_rmpad_rolled"].tolist() == [2, 3, 4, 5, 6, 7, 8, 1]
    assert oa["temperature"].tolist() == [0.5, 2.0]


def test_mrope_positions_both_modes() -> None:
    packed, _ = impl.LMHeadEngine().prepare_model_inputs(seed_batch(mrope=True))
    assert tuple(packed["position_ids"].shape) == (4, 1, 8)
    assert packed["position_ids"][2, 0].tolist() == [2, 3, 4, 5, 6, 2, 3, 4]  # axis a = pos + a
    padded, _ = impl.LMHeadEngine().prepare_model_inputs(seed_batch(mrope=True, use_remove_padding=False))
    assert tuple(padded["position_ids"].shape) == (4, 2, 5)
    assert padded["position_ids"][1].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]


def test_static_bucket_pads_after_the_roll() -> None:
    mb = lengths_batch([[1, 2, 3], [6, 7]], [[4, 5], [8, 9]], temperature=torch.tensor([0.5, 2.0]))  # total 9
    mi, oa = impl.LMHeadEngine(pad_to_length=4, pass_cu_seqlens=True).prepare_model_inputs(mb)
    assert mi["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]]
    assert mi["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert oa["input_ids_rmpad_rolled"].tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 0, 0]
    assert oa["temperature_rmpad"].tolist() == [0.5] * 5 + [2.0] * 4 + [1.0] * 3
    assert oa["pad_size"] == 3
    assert mi["cu_seqlens"].tolist() == [0, 5, 9, 12] and mi["cu_seqlens"].dtype == torch.int32
    assert mi["cu_seqlens_cpu"].device.type == "cpu"


def test_sequence_parallel_slices_the_globally_rolled_row() -> None:
    mb = seed_batch()  # total 8 -> padded to 9 for sp=3
    rank2 = impl.LMHeadEngine(sp_size=3, sp_rank=2).prepare_model_inputs(mb)
    mi, oa = rank2
    assert mi["input_ids"].tolist() == [[7, 8, 0]]
    assert mi["position_ids"].tolist() == [[1, 2, 0]]
    assert oa["input_ids_rmpad_rolled"].tolist() == [8, 1, 0]  # 7 -> 8 inside, never a shard-local wrap
    assert oa["pad_size"] == 1
    rank1 = impl.LMHeadEngine(sp_size=3, sp_rank=1).prepare_model_inputs(mb)[1]
    assert rank1["input_ids_rmpad_rolled"].tolist() == [5, 6, 7]


def test_fused_kernel_inputs() -> None:
    mi, _ = impl.LMHeadEngine().prepare_model_inputs(seed_batch(temperature=0.7, use_fused_kernels=True))
    assert mi["temperature"] == 0.7 and mi["return_dict"] is True
    assert mi["shift_labels"].tolist() == [[2, 3, 4, 5, 6, 7, 8, 1]]
    mi, _ = impl.LMHeadEngine().prepare_model_inputs(
        seed_batch(temperature=0.7, use_fused_kernels=True, use_remove_padding=False))
    assert mi["temperature"] == 0.7 and "shift_labels" not in mi


# --- prepare_model_outputs -------------------------------------------------------------------------

#: logits row k (V = 2) is [a_k, 0]; the ids of the seed batch are 1..8, so use V = 9 with zeros elsewhere.
A = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 1.0, 3.0]


def _rows(temperature=(1.0, 1.0)) -> list[list[float]]:
    rows = []
    for k, a in enumerate(A):
        t = temperature[0] if k < 5 else temperature[1]
        rows.append([a / t] + [0.0] * 8)
    return rows


def _logits(mode: str) -> torch.Tensor:
    flat = torch.tensor([[a] + [0.0] * 8 for a in A])
    if mode == "packed":
        return flat.unsqueeze(0)
    dense = torch.full((2, 5, 9), NAN)
    dense[0, :5], dense[1, :3] = flat[:5], flat[5:]
    return dense


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_log_probs_slice_back_to_response_shape(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", temperature=torch.tensor([0.5, 2.0]))
    engine = impl.LMHeadEngine()
    _, oa = engine.prepare_model_inputs(mb)
    out = engine.prepare_model_outputs(SimpleNamespace(logits=_logits(mode)), oa, mb)
    labels = [2, 3, 4, 5, 6, 7, 8, 1]
    rows = _rows((0.5, 2.0))
    want = [lsm(rows[k], labels[k]) for k in range(8)]
    assert set(out) == {"log_probs"}
    assert torch.allclose(out["log_probs"].values(), torch.tensor(want), atol=1e-6)
    sliced = impl.no_padding_2_padding(out["log_probs"], mb)
    assert tuple(sliced.shape) == (2, 2)
    # response 0 = tokens 4, 5 scored at positions 2, 3; response 1 = token 8 scored at position 6
    assert torch.allclose(sliced, torch.tensor([[want[2], want[3]], [want[6], 0.0]]), atol=1e-6)
    assert sliced[1, 1].item() == 0.0


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_entropy_and_sum_pi_squared_of_uniform_logits(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", calculate_entropy=True, calculate_sum_pi_squared=True)
    _, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    logits = torch.zeros(1, 8, 9) if mode == "packed" else _logits(mode).nan_to_num(0.0) * 0
    if mode == "padded":
        logits[1, 3:] = NAN
    out = impl.LMHeadEngine().prepare_model_outputs(SimpleNamespace(logits=logits), oa, mb)
    assert torch.allclose(out["entropy"].values(), torch.full((8,), math.log(9)), atol=1e-6)
    assert torch.allclose(out["sum_pi_squared"].values(), torch.full((8,), 1 / 9), atol=1e-7)


def _processor(student_logits, data):
    return {"distillation_losses": student_logits.sum(-1), "student_mass": torch.ones_like(student_logits[..., 0])}


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_distillation_keys_in_both_modes(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", distillation_use_topk=True, temperature=2.0)
    _, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    out = impl.LMHeadEngine().prepare_model_outputs(SimpleNamespace(logits=_logits(mode)), oa, mb, _processor)
    assert set(out) == {"log_probs", "distillation_losses", "student_mass"}
    assert torch.allclose(out["distillation_losses"].values(), torch.tensor(A) / 2)  # scaled logits, summed
    assert out["student_mass"].offsets().tolist() == [0, 5, 8]
    mb.set_non_tensor("distillation_only", True)
    out = impl.LMHeadEngine().prepare_model_outputs(SimpleNamespace(logits=_logits(mode)), oa, mb, _processor)
    assert set(out) == {"distillation_losses", "student_mass"}


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_fused_outputs_are_repacked(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", use_fused_kernels=True, calculate_entropy=True)
    _, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    flat = torch.arange(8.0)
    if mode == "packed":
        lp, ent = flat.unsqueeze(0), -flat.unsqueeze(0)
    else:
        lp = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, NAN, NAN]])
        ent = -lp
    out = impl.LMHeadEngine().prepare_model_outputs(SimpleNamespace(log_probs=lp, entropy=ent), oa, mb)
    assert out["log_probs"].values().tolist() == flat.tolist()
    assert out["entropy"].values().tolist() == (-flat).tolist()


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_value_head(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed")
    engine = impl.ValueHeadEngine()
    _, oa = engine.prepare_model_inputs(mb)
    logits = _logits(mode)[..., :1]
    out = engine.prepare_model_outputs(SimpleNamespace(logits=logits), oa, mb)
    assert set(out) == {"values"}
    assert out["values"].values().tolist() == A and out["values"].offsets().tolist() == [0, 5, 8]


def test_sequence_parallel_outputs_gather_and_unpad() -> None:
    mb = seed_batch()
    group = ThreadedAllGather(3)
    engines = [impl.LMHeadEngine(sp_size=3, sp_rank=r, all_gather=group.member(r)) for r in range(3)]
    args = [e.prepare_model_inputs(mb)[1] for e in engines]
    full = torch.cat([_logits("packed"), torch.full((1, 1, 9), NAN)], dim=1)  # tail pad poisoned
    results = [None] * 3

    def run(r):
        results[r] = engines[r].prepare_model_outputs(SimpleNamespace(logits=full[:, 3 * r: 3 * r + 3]), args[r], mb)

    import threading
    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    rows = _rows()
    labels = [2, 3, 4, 5, 6, 7, 8, 1]
    want = torch.tensor([lsm(rows[k], labels[k]) for k in range(8)])
    for result in results:
        assert torch.allclose(result["log_probs"].values(), want, atol=1e-6)


# --- padding helpers -----------------------------------------------------------------------------

def test_no_padding_2_padding_trailing_dims_and_width_flag() -> None:
    mb = seed_batch(max_response_len=3)
    values = torch.arange(16.0).view(8, 2)
    nested = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 5, 8]))
    out = impl.no_padding_2_padding(nested, mb)
    assert tuple(out.shape) == (2, 3, 2)
    assert out.tolist() == [[[4, 5], [6, 7], [0, 0]], [[12, 13], [0, 0], [0, 0]]]


def test_response_from_and_to_nested() -> None:
    mb = seed_batch()
    tensor = torch.nested.nested_tensor_from_jagged(torch.arange(10.0, 18.0), torch.tensor([0, 5, 8]))
    got = impl.response_from_nested(tensor, mb["response_mask"])
    assert [t.tolist() for t in got.unbind()] == [[12.0, 13.0], [16.0]]
    back = impl.response_to_nested(torch.tensor([[1.0, 2.0], [3.0, 9.0]]), mb["response_mask"])
    assert [t.tolist() for t in back.unbind()] == [[1.0, 2.0], [3.0]]


def _dense_batch(mrope: bool = False):
    from tensordict import TensorDict

    pos = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 0]])
    return TensorDict({
        "input_ids": torch.tensor([[7, 1, 2, 3, 4], [0, 5, 6, 8, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]]),
        "response_mask": torch.tensor([[1, 0], [1, 0]]),
        "position_ids": torch.stack([pos] * 4, dim=1) if mrope else pos,
        "teacher_ids": torch.arange(20).view(2, 5, 2),
    }, batch_size=[2])


def test_left_right_2_no_padding() -> None:
    dense = _dense_batch()
    before = {k: dense[k].clone() for k in dense.keys()}
    out = impl.left_right_2_no_padding(dense)
    rows = lambda key: [t.tolist() for t in out[key].unbind()]  # noqa: E731
    assert rows("input_ids") == [[7, 1, 2, 3, 4], [5, 6, 8]]
    assert rows("position_ids") == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert rows("loss_mask") == [[1, 0], [1]] and out["response_mask"] is out["loss_mask"]
    assert "prompts" not in out.keys() and "responses" not in out.keys()  # carried over, as verl does: none here
    assert rows("teacher_ids") == [[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], [[12, 13], [14, 15], [16, 17]]]
    assert out["max_seq_len"] == 5 and out["max_response_len"] == 2
    assert set(dense.keys()) == set(before) and all(torch.equal(dense[k], v) for k, v in before.items())


@pytest.mark.parametrize("rows", [1, 2])
def test_left_right_mrope_positions_stay_b4j(rows: int) -> None:
    dense = _dense_batch(mrope=True)[:rows]  # one row, or rows of different lengths
    out = impl.left_right_2_no_padding(dense)
    pos = out["position_ids"]
    assert pos.dim() == 3 and pos.shape[1] == 4 and pos._ragged_idx == 2
    assert pos.unbind()[0].tolist() == [[0, 1, 2, 3, 4]] * 4


def test_logit_functions() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    assert impl.logprobs_from_logits(logits, torch.tensor([1])).item() == pytest.approx(lsm([1.0, 2.0, 0.0], 1))
    p = [math.exp(x) / sum(math.exp(y) for y in (1.0, 2.0, 0.0)) for x in (1.0, 2.0, 0.0)]
    assert impl.entropy_from_logits(logits).item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-6)
    assert impl.sum_pi_squared_from_logits(logits).item() == pytest.approx(sum(q * q for q in p), rel=1e-6)


def test_entropy_is_stable_at_low_temperature() -> None:
    # lse - sum(p * logits) cancels in float32 here; -sum(p log p) does not
    logits = torch.tensor([[5000.0, 4990.0, 0.0]])
    want = -sum(q * math.log(q) for q in (1 / (1 + math.exp(-10)), math.exp(-10) / (1 + math.exp(-10))))
    assert impl.entropy_from_logits(logits).item() == pytest.approx(want, rel=1e-3)


def test_temperature_is_clamped_below_at_1e_8() -> None:
    mb = seed_batch()
    _, oa = impl.LMHeadEngine().prepare_model_inputs(mb)
    oa = {**oa, "temperature_rmpad": torch.zeros(8)}  # as a caller could hand it
    logits = torch.zeros(1, 8, 9)
    logits[0, :, 0] = 1e-9  # /1e-8 -> 0.1 on id 0, 0 elsewhere
    out = impl.LMHeadEngine().prepare_model_outputs(SimpleNamespace(logits=logits), oa, mb)
    labels = [2, 3, 4, 5, 6, 7, 8, 1]
    want = [lsm([0.1] + [0.0] * 8, k) for k in labels]
    assert torch.allclose(out["log_probs"].values(), torch.tensor(want), atol=1e-5)
