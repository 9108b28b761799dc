"""Worked examples for impl behaviour the contract leaves to the engine, found by mutation testing
(docs/mutation.md): the spec cannot demand them of every engine (verl differs), impl documents them.

Expectations are computed by hand (or by a direct formula on a few rows), never by impl.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import impl
from impl.errors import UnsupportedConfigError
from impl.logits import token_statistics
from tests.batches import seed_batch

# the seed batch: ids [1 2 3 4 5 | 6 7 8], lengths [5, 3], responses [2, 1]; V = 9
A = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 1.0, 3.0]
LABELS = [2, 3, 4, 5, 6, 7, 8, 1]  # the packed row rolled by one


def _logits(mode: str) -> torch.Tensor:
    """Row k is [A[k], 0, ..., 0] (k over the packed tokens); padded rows beyond n_i hold NaN."""
    flat = torch.tensor([[a] + [0.0] * 8 for a in A])
    if mode == "packed":
        return flat.unsqueeze(0)
    dense = torch.full((2, 5, 9), float("nan"))
    dense[0, :5], dense[1, :3] = flat[:5], flat[5:]
    return dense


def _sum_pi_squared(a: float, t: float) -> float:
    z = [a / t] + [0.0] * 8
    e = [math.exp(x) for x in z]
    s = sum(e)
    return sum((x / s) ** 2 for x in e)


def _dense_like(mode: str, flat: torch.Tensor) -> torch.Tensor:
    if mode == "packed":
        return flat.unsqueeze(0)
    dense = torch.full((2, 5), float("nan"))
    dense[0, :5], dense[1, :3] = flat[:5], flat[5:]
    return dense


# --- verl's spelling of the width flag ------------------------------------------------------------

def test_max_response_length_is_verls_spelling_of_the_width_flag() -> None:
    mb = seed_batch(max_response_length=4)
    assert impl.BatchFlags.from_batch(mb).max_response_len == 4
    nested = torch.nested.nested_tensor_from_jagged(torch.arange(8.0), torch.tensor([0, 5, 8]))
    out = impl.no_padding_2_padding(nested, mb)
    assert out.tolist() == [[2, 3, 0, 0], [6, 0, 0, 0]]  # values[e - r - 1 : e - 1], zero-padded to 4
    both = seed_batch(max_response_len=3, max_response_length=4)  # the contract's name wins
    assert tuple(impl.no_padding_2_padding(nested, both).shape) == (2, 3)


# --- fused kernels next to outputs that need the logits -------------------------------------------

@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_fused_kernels_with_sum_pi_squared_take_it_from_the_logits(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", use_fused_kernels=True, calculate_entropy=True,
                    calculate_sum_pi_squared=True, temperature=2.0)
    engine = impl.LMHeadEngine()
    _, oa = engine.prepare_model_inputs(mb)
    # the model's own (fused) log_probs/entropy: arbitrary marker values, returned as they are
    lp, ent = -torch.arange(1.0, 9.0), torch.arange(10.0, 18.0)
    output = SimpleNamespace(logits=_logits(mode), log_probs=_dense_like(mode, lp), entropy=_dense_like(mode, ent))
    out = engine.prepare_model_outputs(output, oa, mb)
    assert set(out) == {"log_probs", "entropy", "sum_pi_squared"}
    assert out["log_probs"].values().tolist() == lp.tolist()
    assert out["entropy"].values().tolist() == ent.tolist()
    want = torch.tensor([_sum_pi_squared(a, 2.0) for a in A])
    assert torch.allclose(out["sum_pi_squared"].values(), want, atol=1e-6)
    assert out["sum_pi_squared"].offsets().tolist() == [0, 5, 8]


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_fused_kernels_with_distillation_pass_scaled_logits_to_the_processor(mode: str) -> None:
    mb = seed_batch(use_remove_padding=mode == "packed", use_fused_kernels=True, distillation_use_topk=True,
                    temperature=2.0)
    engine = impl.LMHeadEngine()
    _, oa = engine.prepare_model_inputs(mb)
    lp = -torch.arange(1.0, 9.0)
    seen = []

    def processor(student_logits, data):
        seen.append(student_logits)
        return {"student_mass": student_logits[..., 0]}

    out = engine.prepare_model_outputs(SimpleNamespace(logits=_logits(mode), log_probs=_dense_like(mode, lp)),
                                       oa, mb, processor)
    assert set(out) == {"log_probs", "student_mass"}
    assert out["log_probs"].values().tolist() == lp.tolist()
    assert tuple(seen[0].shape) == (1, 8, 9)
    assert out["student_mass"].values().tolist() == [a / 2 for a in A]
    mb.set_non_tensor("distillation_only", True)
    out = engine.prepare_model_outputs(SimpleNamespace(logits=_logits(mode)), oa, mb, processor)
    assert set(out) == {"student_mass"}


def test_fused_kernels_without_logits_cannot_give_sum_pi_squared() -> None:
    mb = seed_batch(use_fused_kernels=True, calculate_sum_pi_squared=True)
    engine = impl.LMHeadEngine()
    _, oa = engine.prepare_model_inputs(mb)
    with pytest.raises(UnsupportedConfigError, match="logits"):
        engine.prepare_model_outputs(SimpleNamespace(log_probs=torch.zeros(1, 8)), oa, mb)
    only = seed_batch(use_fused_kernels=True)  # nothing needs the logits: none are asked for
    _, oa = engine.prepare_model_inputs(only)
    assert set(engine.prepare_model_outputs(SimpleNamespace(log_probs=torch.zeros(1, 8)), oa, only)) == {"log_probs"}


# --- vocabularies above 2**20: one logits row per chunk ---------------------------------------------

def test_token_statistics_above_two_to_the_twenty_vocab() -> None:
    vocab, total = (1 << 20) + 3, 3
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(total, vocab, generator=gen)
    labels = torch.tensor([0, vocab - 1, 12345])
    calls = []

    def rows(start, stop):
        calls.append((start, stop))
        return logits[start:stop]

    out = token_statistics(rows, total, vocab, labels, entropy=True, sum_pi_squared=True)
    assert calls == [(0, 1), (1, 2), (2, 3)]  # 1 MiB chunks hold less than one row: one row each
    lsm = torch.log_softmax(logits.double(), dim=-1)
    p = lsm.exp()
    assert torch.allclose(out["log_probs"].double(), lsm.gather(1, labels.unsqueeze(1)).squeeze(1), atol=1e-5)
    assert torch.allclose(out["entropy"].double(), -(p * lsm).sum(-1), atol=1e-4)
    assert torch.allclose(out["sum_pi_squared"].double(), (p * p).sum(-1), atol=1e-7)


# --- response lengths and packed inputs of the slice helper ------------------------------------------

def test_no_padding_2_padding_takes_packed_tensors_and_any_response_key() -> None:
    mb = seed_batch()
    values = torch.arange(8.0)
    want = [[2, 3], [6, 0]]  # values[e - r - 1 : e - 1]: e = 5, 8; r = 2, 1
    assert impl.no_padding_2_padding(values, mb).tolist() == want  # dense (total_nnz,) as a packed row
    nested = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 5, 8]))
    for keep in ("responses", "response_mask", "loss_mask"):  # lengths from whichever nested response key is there
        part = mb.copy()
        for key in ("responses", "response_mask", "loss_mask"):
            if key != keep:
                del part[key]
        assert impl.no_padding_2_padding(nested, part).tolist() == want


def test_response_lengths_of_a_dense_batch() -> None:
    from impl.padding import response_lengths
    from tensordict import TensorDict

    # prompt columns 0..2 (left-padded), response columns 3..5 (right-padded): r = [1, 3]
    dense = TensorDict({"attention_mask": torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
                        "response_mask": torch.tensor([[1, 0, 0], [1, 0, 1]])}, batch_size=[2])
    lengths = response_lengths(dense, torch.device("cpu"))
    assert lengths.tolist() == [1, 3] and lengths.dtype == torch.int64


# --- the torch.distributed all-gather seam, on a one-process gloo group -----------------------------

_ONE_RANK_GATHER = """
import sys
import torch
import torch.distributed as dist
from impl.sequence_parallel import TorchDistributedAllGather

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
local = torch.arange(6.0).view(3, 2)
gathered = TorchDistributedAllGather()(local)
assert gathered.shape == (3, 2) and torch.equal(gathered, local)  # world 1: the local rows, in order
print("GATHERED", flush=True)
dist.destroy_process_group()
"""


def test_torch_distributed_all_gather_on_one_rank(tmp_path) -> None:
    """In a process of its own: on torch 2.4 gloo's ``destroy_process_group`` hung for good in a test worker that had
    run other tests (the whole tox run waited on it), so the group lives in a fresh process, killed if it has not
    exited within 120 s; the gather's check is what it printed before its destroy."""
    import subprocess
    import sys

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    proc = subprocess.Popen([sys.executable, "-c", _ONE_RANK_GATHER, f"file://{tmp_path / 'store'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    assert "GATHERED" in out, err


# --- left_right_2_no_padding: a key of the wrong dimensionality ------------------------------------

def test_left_right_key_of_wrong_dims_names_key_and_shape() -> None:
    from tensordict import TensorDict

    base = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.tensor([[1, 1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1]]), "position_ids": torch.tensor([[0, 1, 2, 3]])}
    flat = TensorDict(dict(base, position_ids=torch.tensor([[[[0, 1, 2, 3]]]])), batch_size=[1])
    with pytest.raises(impl.ShapeError, match=r"'position_ids' must be a dense tensor with 2 or 3 dims, got \(1, 1, 1, 4\)"):
        impl.left_right_2_no_padding(flat)
