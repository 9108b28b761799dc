"""impl's padding helpers as a drop-in for verl's: input class by input class.

Each class is a batch shape verl's own CPU tests of ``verl.workers.utils.padding`` or verl's
trainer feed the helpers, built here from its description (nothing is copied from verl). For
each, impl either returns verl's result (compared bit for bit in the same process when verl is
importable: ``tox -e verl091`` (``.ci/steps.sh verl091``), or ``. .venv-verl/bin/activate; PYTHONPATH=$PWD pytest
tests/test_dropin.py``) or raises / warns as docs/verl-differences.md says. Without verl the
comparisons skip; the expectations computed here from the dense tensors still run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
import torch
from tensordict import TensorDict

import impl
from impl import BatchMismatchError, LayoutWarning, ShapeError

try:  # verl pins tensordict<=0.10: it lives in its own environment
    from verl.workers.utils import padding as verl_padding
except Exception:  # noqa: BLE001 - any import failure means "no verl here"
    verl_padding = None

needs_verl = pytest.mark.skipif(verl_padding is None, reason="verl is not importable (run in the verl env)")


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    lens = torch.tensor([r.shape[0] for r in rows])
    return torch.nested.nested_tensor_from_jagged(torch.cat(rows), torch.nn.functional.pad(lens.cumsum(0), (1, 0)))


@dataclass
class DenseBatch:
    """A dense batch and what the test knows about it."""

    name: str
    data: TensorDict
    #: the true response length of each row (None: the batch does not say)
    response_lens: list[int] | None
    #: LayoutWarning expected from the default call, and the message fragment
    warns: str | None = None
    extra: dict = field(default_factory=dict)


def _left_right(prompt_lens, response_lens, prompt_width, response_width, *, seed=0, holes=False,
                mrope=False, topk=0, float_masks=False, batch_size=True, extra_keys=False) -> TensorDict:
    """The trainer's layout: prompt left-padded in the first P columns, response right-padded in the last R."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(prompt_lens), prompt_width + response_width
    cols = torch.arange(seq)
    p, r = torch.tensor(prompt_lens).unsqueeze(1), torch.tensor(response_lens).unsqueeze(1)
    attn = ((cols >= prompt_width - p) & (cols < prompt_width + r)).long()
    ids = torch.randint(1, 1000, (batch, seq), generator=gen) * attn
    resp = attn[:, prompt_width:].clone()
    if holes:
        resp = resp * (torch.rand(batch, response_width, generator=gen) > 0.3)
    pos = (attn.cumsum(1) - 1).clamp(min=0) * attn
    data = {"input_ids": ids, "attention_mask": attn.float() if float_masks else attn,
            "response_mask": resp.float() if float_masks else resp,
            "position_ids": torch.stack([pos + a * attn for a in range(4)], 1) if mrope else pos,
            "prompts": ids[:, :prompt_width].clone(), "responses": ids[:, prompt_width:].clone()}
    if topk:
        data["teacher_ids"] = torch.randint(0, 1000, (batch, seq, topk), generator=gen)
        data["teacher_logprobs"] = torch.randn(batch, seq, topk, generator=gen)
        data["routed_experts"] = torch.randint(0, 8, (batch, seq, 2, 3), generator=gen)
    if extra_keys:  # per-sample dense tensors the trainer carries along
        data["old_log_probs"] = torch.randn(batch, seq, generator=gen)
        data["advantages"] = torch.randn(batch, response_width, generator=gen)
    return TensorDict(data, batch_size=[batch] if batch_size else [])


def _right_padded(prompt_lens, response_lens, seq, response_width, *, nested_split=True, resp_mask_lens=None,
                  batch_size=True, extra_keys=False) -> TensorDict:
    """Whole sequences right-padded from column 0 (prompt and response contiguous, no left padding)."""
    batch = len(prompt_lens)
    n = torch.tensor(prompt_lens) + torch.tensor(response_lens)
    attn = (torch.arange(seq).unsqueeze(0) < n.unsqueeze(1)).float()
    ids = torch.zeros(batch, seq, dtype=torch.long)
    ids[attn.bool()] = torch.cat([torch.arange(1, k + 1) for k in n.tolist()])
    lens = torch.tensor(resp_mask_lens or response_lens)
    resp = (torch.arange(response_width).unsqueeze(0) < lens.unsqueeze(1)).float()
    data = {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
            "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, -1).clone()}
    if nested_split:
        data["prompts"] = _nested([ids[i, :p] for i, p in enumerate(prompt_lens)])
        data["responses"] = _nested([ids[i, p:p + r] for i, (p, r) in enumerate(zip(prompt_lens, response_lens))])
    if extra_keys:
        data["old_log_probs"] = torch.randn(batch, seq)
        data["advantages"] = torch.randn(batch, response_width)
    return TensorDict(data, batch_size=[batch] if batch_size else [])


def input_classes() -> list[DenseBatch]:
    holes_attn = _left_right([3, 2], [2, 3], 4, 3, seed=5)
    holes_attn["attention_mask"] = holes_attn["attention_mask"].clone()
    holes_attn["attention_mask"][0, 2] = 0  # a hole inside row 0's prompt
    return [
        DenseBatch("trainer_left_right", _left_right([3, 1, 5, 2], [2, 4, 1, 3], 6, 5, seed=1, holes=True, topk=2),
                   [2, 4, 1, 3]),
        DenseBatch("trainer_left_right_mrope_float_masks",
                   _left_right([3, 1], [2, 4], 4, 4, seed=2, mrope=True, float_masks=True), [2, 4]),
        DenseBatch("no_padding_all_ones", _left_right([6, 6, 6], [3, 3, 3], 6, 3, seed=3, batch_size=False),
                   [3, 3, 3]),
        # verl's varying-length round trip: every whole sequence fits in the first S - R columns;
        # the split comes from the nested prompts/responses the batch carries
        DenseBatch("right_padded_nested_split", _right_padded([10, 30, 5, 40], [40, 20, 45, 10], 100, 50,
                                                              batch_size=False), [40, 20, 45, 10]),
        DenseBatch("right_padded_long_rows_nested_split", _right_padded([2, 5], [4, 3], 9, 4), [4, 3]),
        # verl's "log-probs stay padded" test: whole sequences from column 0, response_mask marking r_i
        # response-relative columns, no split given: masks inconsistent with the column split
        DenseBatch("right_padded_inconsistent_masks",
                   _right_padded([50, 60, 45, 64], [50, 60, 45, 64], 128, 64, nested_split=False,
                                 batch_size=False, extra_keys=True), None, warns="past the response lengths"),
        DenseBatch("attention_holes", holes_attn, None, warns="not left-padded"),
    ]


CLASSES = {c.name: c for c in input_classes()}
IDS = list(CLASSES)


def _snapshot(data: TensorDict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) and not v.is_nested else v) for k, v in data.items()}


def _impl(batch: DenseBatch, **kwargs) -> TensorDict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = impl.left_right_2_no_padding(batch.data, **kwargs)
    layout = [str(w.message) for w in caught if issubclass(w.category, LayoutWarning)]
    if batch.warns:
        assert any(batch.warns in m for m in layout), f"expected a LayoutWarning with {batch.warns!r}, got {layout}"
    else:
        assert not layout, f"unexpected LayoutWarning: {layout}"
    return out


def _rows(value: torch.Tensor) -> list[list]:
    return [t.tolist() for t in value.unbind()]


@pytest.mark.parametrize("name", IDS)
def test_compacts_by_attention_mask_wherever_the_padding_sits(name: str) -> None:
    batch = CLASSES[name]
    before = _snapshot(batch.data)
    out = _impl(batch)
    mask = batch.data["attention_mask"].bool()
    assert _rows(out["input_ids"]) == [row[m].tolist() for row, m in zip(batch.data["input_ids"], mask)]
    pos = batch.data["position_ids"]
    want = [(row[:, m] if pos.dim() == 3 else row[m]).tolist() for row, m in zip(pos, mask)]
    assert _rows(out["position_ids"]) == want
    for key in ("teacher_ids", "teacher_logprobs", "routed_experts"):
        if key in batch.data.keys():
            assert _rows(out[key]) == [row[m].tolist() for row, m in zip(batch.data[key], mask)]
    assert out["max_seq_len"] == mask.shape[1] and out["max_response_len"] == batch.data["response_mask"].shape[1]
    for key, value in before.items():  # input untouched; other keys carried over as they were
        now = batch.data.get(key)
        assert now is value or torch.equal(now, value)
        if key not in ("input_ids", "position_ids", "response_mask", "teacher_ids", "teacher_logprobs",
                       "routed_experts"):
            assert out.get(key) is batch.data.get(key)


@pytest.mark.parametrize("name", [n for n, c in CLASSES.items() if c.response_lens is not None])
def test_loss_mask_is_the_response_mask_of_the_response_tokens(name: str) -> None:
    batch = CLASSES[name]
    out = _impl(batch)
    want = [row[:r].tolist() for row, r in zip(batch.data["response_mask"], batch.response_lens)]
    assert _rows(out["loss_mask"]) == want and out["response_mask"] is out["loss_mask"]


@pytest.mark.parametrize("name", [n for n, c in CLASSES.items() if c.response_lens is not None])
def test_round_trip_slices_the_true_responses(name: str) -> None:
    batch = CLASSES[name]
    out = _impl(batch)
    ids = out["input_ids"]
    scored = torch.nested.nested_tensor_from_jagged(torch.roll(ids.values(), -1).float(), ids.offsets())
    sliced = impl.no_padding_2_padding(scored, out)
    seqs = _rows(ids)
    for i, r in enumerate(batch.response_lens):
        assert sliced[i, :r].tolist() == [float(t) for t in seqs[i][-r:]]
        assert not sliced[i, r:].any()


@pytest.mark.parametrize("name", [n for n, c in CLASSES.items() if c.warns])
def test_strict_raises_where_the_split_is_a_guess(name: str) -> None:
    batch = CLASSES[name]
    with pytest.raises(ShapeError, match="strict=True") as info:
        impl.left_right_2_no_padding(batch.data, strict=True)
    assert batch.warns in str(info.value)


def test_strict_accepts_what_it_can_split() -> None:
    for batch in CLASSES.values():
        if not batch.warns:
            impl.left_right_2_no_padding(batch.data, strict=True)


def test_no_response_by_the_columns_warns_without_a_nested_split() -> None:
    data = _right_padded([2, 3], [1, 1], 6, 2, nested_split=False)  # whole sequences inside the prompt columns
    with pytest.warns(LayoutWarning, match="no valid token among the last 2"):
        out = impl.left_right_2_no_padding(data)
    assert _rows(out["loss_mask"]) == [[], []]
    with pytest.raises(ShapeError, match="nested 'prompts'/'responses'"):
        impl.left_right_2_no_padding(data, strict=True)


def test_nested_prompts_that_disagree_with_the_mask() -> None:
    data = _right_padded([2, 5], [4, 3], 9, 4)
    data["prompts"] = _nested([torch.ones(3, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    with pytest.warns(LayoutWarning, match="nested 'prompts' lengths"):
        impl.left_right_2_no_padding(data)
    with pytest.raises(ShapeError, match=r"\[3, 5\]"):
        impl.left_right_2_no_padding(data, strict=True)


def test_nested_responses_of_another_batch_size() -> None:
    data = _right_padded([2, 5], [4, 3], 9, 4)
    data = TensorDict({**{k: data[k] for k in ("input_ids", "attention_mask", "response_mask", "position_ids")},
                       "responses": _nested([torch.ones(2)])}, batch_size=[])
    with pytest.raises(BatchMismatchError, match="1 rows, input_ids has 2"):
        impl.left_right_2_no_padding(data)


# --- against verl, in the same process -------------------------------------------------------------


def _verl_left_right(data: TensorDict) -> TensorDict:
    return verl_padding.left_right_2_no_padding(data.copy())  # verl converts its argument in place


def _same_nested(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.is_nested and b.is_nested, key
    assert a.dtype == b.dtype, f"{key}: {a.dtype} vs {b.dtype}"
    assert torch.equal(a.offsets(), b.offsets()), f"{key}: offsets differ"
    assert torch.equal(a.values(), b.values()), f"{key}: values differ"


@needs_verl
@pytest.mark.parametrize("name", IDS)
def test_left_right_matches_verl_bit_for_bit(name: str) -> None:
    batch = CLASSES[name]
    ours, theirs = _impl(batch), _verl_left_right(batch.data)
    _same_nested(ours["input_ids"], theirs["input_ids"], "input_ids")
    if batch.data["position_ids"].dim() == 2:  # verl's mRoPE nesting guesses the ragged dim: compare rows
        _same_nested(ours["position_ids"], theirs["position_ids"], "position_ids")
    else:
        assert all(torch.equal(a, b) for a, b in zip(ours["position_ids"].unbind(), theirs["position_ids"].unbind()))
    for key in ("teacher_ids", "teacher_logprobs", "routed_experts"):
        if key in batch.data.keys():
            _same_nested(ours[key], theirs[key], key)
    for key in ("max_seq_len", "max_response_len"):
        assert ours[key] == theirs[key]
    # verl keeps response_mask dense and aliases loss_mask to it; impl nests it over the response tokens
    dense = theirs["loss_mask"]
    assert not dense.is_nested and torch.equal(dense, batch.data["response_mask"])
    if batch.response_lens is not None:
        assert _rows(ours["loss_mask"]) == [row[:r].tolist() for row, r in zip(dense, batch.response_lens)]
    for key in set(theirs.keys()) - {"input_ids", "position_ids", "loss_mask", "response_mask", "indices",
                                      "max_seq_len", "max_response_len", "teacher_ids", "teacher_logprobs",
                                      "routed_experts"}:
        assert ours.get(key) is theirs.get(key) or torch.equal(ours.get(key), theirs.get(key)), key


@needs_verl
@pytest.mark.parametrize("name", [n for n, c in CLASSES.items() if c.response_lens is not None])
def test_round_trip_matches_verl(name: str) -> None:
    batch = CLASSES[name]
    ours, theirs = _impl(batch), _verl_left_right(batch.data)
    if batch.data["attention_mask"].is_floating_point() and not theirs["prompts"].is_nested:
        # verl's dense-prompts path sums the float mask into float lengths and fails at slicing
        with pytest.raises(TypeError):
            verl_padding.no_padding_2_padding(torch.zeros(ours["input_ids"].values().shape[0]), theirs)
        return
    values = torch.randn(ours["input_ids"].values().shape[0], generator=torch.Generator().manual_seed(3))
    scored = torch.nested.nested_tensor_from_jagged(values, ours["input_ids"].offsets())
    got = impl.no_padding_2_padding(scored, ours)
    want = verl_padding.no_padding_2_padding(scored, theirs)
    assert got.shape == want.shape and torch.equal(got, want)


def _jagged_pair(seed: int, lens: list[int], resp: list[int], trailing: tuple[int, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(sum(lens), *trailing, generator=gen)
    tensor = torch.nested.nested_tensor_from_jagged(values, torch.nn.functional.pad(torch.tensor(lens).cumsum(0), (1, 0)))
    mask = _nested([torch.ones(r) for r in resp])
    return tensor, mask


HELPER_CASES = [([5, 3, 7], [2, 1, 4], ()), ([4, 4], [3, 3], ()), ([6], [5], (3,)), ([2, 9, 3], [1, 8, 1], (2, 2))]


@needs_verl
@pytest.mark.parametrize("lens, resp, trailing", HELPER_CASES)
def test_response_helpers_match_verl(lens, resp, trailing) -> None:
    tensor, mask = _jagged_pair(sum(lens), lens, resp, trailing)
    ours, theirs = impl.response_from_nested(tensor, mask), verl_padding.response_from_nested(tensor, mask)
    assert all(torch.equal(a, b) for a, b in zip(ours.unbind(), theirs.unbind()))
    dense = torch.randn(len(resp), max(resp) + 2, *trailing)
    ours, theirs = impl.response_to_nested(dense, mask), verl_padding.response_to_nested(dense, mask)
    assert all(torch.equal(a, b) for a, b in zip(ours.unbind(), theirs.unbind()))
    ids = torch.nested.nested_tensor_from_jagged(torch.zeros(sum(lens), dtype=torch.long), tensor.offsets())
    for width in (None, max(lens) + 3):
        assert torch.equal(impl.build_attention_mask_from_nested(ids, width),
                           verl_padding.build_attention_mask_from_nested(ids, width))


@needs_verl
@pytest.mark.parametrize("lens, resp, trailing", HELPER_CASES)
@pytest.mark.parametrize("packed", [False, True])
def test_no_padding_2_padding_matches_verl(lens, resp, trailing, packed) -> None:
    tensor, _ = _jagged_pair(7, lens, resp, trailing)
    prompts = _nested([torch.ones(n - r, dtype=torch.long) for n, r in zip(lens, resp)])
    responses = _nested([torch.ones(r, dtype=torch.long) for r in resp])
    data = TensorDict({"prompts": prompts, "responses": responses,
                       "input_ids": torch.nested.nested_tensor_from_jagged(torch.zeros(sum(lens), dtype=torch.long),
                                                                           tensor.offsets())}, batch_size=[len(lens)])
    arg = tensor.values() if packed else tensor
    assert torch.equal(impl.no_padding_2_padding(arg, data), verl_padding.no_padding_2_padding(arg, data))
    data.set_non_tensor("max_response_len", max(resp) + 2)
    assert torch.equal(impl.no_padding_2_padding(arg, data), verl_padding.no_padding_2_padding(arg, data))


# --- the remaining differences: verl returns a silently wrong tensor, impl raises ------------------


def test_narrower_than_the_data_raises() -> None:
    tensor, mask = _jagged_pair(1, [5, 3], [3, 2])
    ids = torch.nested.nested_tensor_from_jagged(torch.zeros(8, dtype=torch.long), tensor.offsets())
    with pytest.raises(ShapeError, match="shorter than the longest sequence"):
        impl.build_attention_mask_from_nested(ids, 4)
    with pytest.raises(ShapeError, match="longest response has 3"):
        impl.response_to_nested(torch.zeros(2, 2), mask)
    if verl_padding is not None:  # verl truncates without a word
        assert verl_padding.build_attention_mask_from_nested(ids, 4).shape == (2, 4)
        assert [t.numel() for t in verl_padding.response_to_nested(torch.zeros(2, 2), mask).unbind()] == [2, 2]
