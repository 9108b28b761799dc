"""Bad input raises a typed exception whose message names the key and the shapes."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict

import impl
from impl import (BatchMismatchError, FlagTypeError, NestedLayoutError, PrepError, ShapeError, TemperatureError,
                  UnsupportedConfigError)
from tests.batches import seed_batch

ENGINE = impl.LMHeadEngine()


@contextmanager
def raises(exc_type, *fragments):
    """``exc_type`` (a PrepError) whose message contains every fragment."""
    with pytest.raises(exc_type) as info:
        yield info
    assert isinstance(info.value, PrepError)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


def test_error_classes_subclass_builtins() -> None:
    assert issubclass(NestedLayoutError, TypeError) and issubclass(FlagTypeError, TypeError)
    for cls in (BatchMismatchError, ShapeError, TemperatureError, UnsupportedConfigError):
        assert issubclass(cls, ValueError) and issubclass(cls, PrepError)


def test_dense_input_ids() -> None:
    mb = seed_batch()
    mb = TensorDict({"input_ids": torch.ones(2, 5, dtype=torch.int64)}, batch_size=[2])
    with raises(NestedLayoutError, "'input_ids'", "(2, 5)"):
        ENGINE.prepare_model_inputs(mb)


def test_strided_nested_input_ids() -> None:
    ids = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)])  # torch.strided layout
    with raises(NestedLayoutError, "'input_ids'", "jagged"):
        impl.build_attention_mask_from_nested(ids)


def test_values_longer_than_offsets() -> None:
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(9), torch.tensor([0, 5, 8]))
    with raises(NestedLayoutError, "'input_ids'", "offsets end at 8", "9"):
        impl.build_attention_mask_from_nested(ids)


def test_empty_sequence() -> None:
    mb = seed_batch()
    mb["input_ids"] = torch.nested.nested_tensor_from_jagged(torch.arange(8), torch.tensor([0, 8, 8]))
    with raises(ShapeError, "'input_ids'", "empty sequence", "[8, 0]"):
        ENGINE.prepare_model_inputs(mb)


def test_empty_batch() -> None:
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(0), torch.tensor([0]))
    with raises(ShapeError, "'input_ids'", "empty batch"):
        impl.build_attention_mask_from_nested(ids)


def test_missing_key() -> None:
    mb = seed_batch()
    del mb["position_ids"]
    with pytest.raises(KeyError, match="position_ids"):
        ENGINE.prepare_model_inputs(mb)


def test_position_ids_lengths_mismatch() -> None:
    mb = seed_batch()
    mb["position_ids"] = torch.nested.nested_tensor_from_jagged(torch.arange(8), torch.tensor([0, 4, 8]))
    with raises(BatchMismatchError, "'position_ids'", "[4, 4]", "[5, 3]"):
        ENGINE.prepare_model_inputs(mb)


def test_mrope_position_ids_with_guessed_ragged_dim() -> None:
    mb = seed_batch()
    rows = [torch.zeros(4, 4, dtype=torch.int64), torch.zeros(4, 4, dtype=torch.int64)]
    mb["input_ids"] = torch.nested.nested_tensor_from_jagged(torch.arange(8), torch.tensor([0, 4, 8]))
    mb["position_ids"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # equal lengths: (B, j, 4)
    with raises(NestedLayoutError, "'position_ids'", "jagged_dim=2"):
        ENGINE.prepare_model_inputs(mb)


@pytest.mark.parametrize("temperature, fragment", [
    (torch.tensor([1.0, 1.0, 1.0]), "(2,) tensor, got shape (3,)"),
    (torch.tensor([[1.0, 1.0]]), "shape (1, 2)"),
    (torch.tensor([1.0, 0.0]), "> 0"),
    (torch.tensor([1.0, float("nan")]), "finite"),
    (-1.0, "> 0"),
    ("hot", "str"),
])
def test_bad_temperature(temperature, fragment) -> None:
    with raises(TemperatureError, "'temperature'", fragment):
        ENGINE.prepare_model_inputs(seed_batch(temperature=temperature))


def test_missing_temperature() -> None:
    mb = seed_batch()
    del mb["temperature"]
    with raises(TemperatureError, "'temperature'"):
        ENGINE.prepare_model_inputs(mb)


def test_fused_kernels_with_per_sample_temperature() -> None:
    with raises(TemperatureError, "use_fused_kernels", "(2,)"):
        ENGINE.prepare_model_inputs(seed_batch(use_fused_kernels=True, temperature=torch.tensor([0.5, 1.0])))


def test_bucket_with_topk_distillation() -> None:
    with raises(UnsupportedConfigError, "pad_to_length=8", "distillation_use_topk"):
        impl.LMHeadEngine(pad_to_length=8).prepare_model_inputs(seed_batch(distillation_use_topk=True))


@pytest.mark.parametrize("mode, fragment", [("right", "only 'no_padding'"), ("bogus", "known modes")])
def test_pad_modes(mode, fragment) -> None:
    with raises(UnsupportedConfigError, "'pad_mode'", repr(mode), fragment):
        ENGINE.prepare_model_inputs(seed_batch(pad_mode=mode))


def test_flag_of_wrong_type() -> None:
    with raises(FlagTypeError, "'calculate_entropy'", "'yes'"):
        ENGINE.prepare_model_inputs(seed_batch(calculate_entropy="yes"))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"sp_size": 2, "sp_rank": 2}, "sp_rank"), ({"sp_size": 0}, "sp_size"), ({"pad_to_length": 0}, "pad_to_length"),
])
def test_bad_engine_settings(kwargs, fragment) -> None:
    with raises(UnsupportedConfigError, fragment):
        impl.LMHeadEngine(**kwargs)


def _outputs(mode, logits, processor=None, **flags):
    mb = seed_batch(use_remove_padding=mode == "packed", **flags)
    _, oa = ENGINE.prepare_model_inputs(mb)
    return ENGINE.prepare_model_outputs(SimpleNamespace(logits=logits), oa, mb, processor)


@pytest.mark.parametrize("mode, shape, fragment", [
    ("packed", (1, 7, 9), "(1, 7, 9)"), ("packed", (8, 9), "(8, 9)"), ("padded", (2, 4, 9), "(2, 5, '*')"),
    ("padded", (3, 5, 9), "(3, 5, 9)"),
])
def test_logits_of_wrong_shape(mode, shape, fragment) -> None:
    with raises(ShapeError, "'logits'", fragment):
        _outputs(mode, torch.zeros(shape))


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_logits_vocab_too_small(mode) -> None:
    shape = (1, 8, 4) if mode == "packed" else (2, 5, 4)
    with raises(ShapeError, "vocab size 4", "[1, 8]"):
        _outputs(mode, torch.zeros(shape))


def test_processor_output_of_wrong_length() -> None:
    def processor(student_logits, data):
        return {"distillation_losses": torch.zeros(1, 7)}
    with raises(ShapeError, "'distillation_losses'", "(1, 7)", "(1, 8)"):
        _outputs("packed", torch.zeros(1, 8, 9), processor, distillation_use_topk=True)


def test_distillation_without_processor() -> None:
    with raises(UnsupportedConfigError, "logits_processor_func"):
        _outputs("padded", torch.zeros(2, 5, 9), None, distillation_use_topk=True)


def test_output_args_from_another_configuration() -> None:
    mb = seed_batch()
    _, oa = impl.LMHeadEngine(pad_to_length=16).prepare_model_inputs(mb)
    with raises(ShapeError, "pad_size"):
        ENGINE.prepare_model_outputs(SimpleNamespace(logits=torch.zeros(1, 16, 9)), oa, mb)


def test_zero_length_prompt_for_the_response_slice() -> None:
    mb = seed_batch()
    mb["responses"] = torch.nested.nested_tensor_from_jagged(torch.arange(8), torch.tensor([0, 5, 8]))
    tensor = torch.nested.nested_tensor_from_jagged(torch.zeros(8), torch.tensor([0, 5, 8]))
    with raises(ShapeError, "prompt of >= 1 token", "[5, 3]"):
        impl.no_padding_2_padding(tensor, mb)
    with raises(ShapeError, "prompt of >= 1 token"):
        impl.response_from_nested(tensor, mb["responses"])


def test_max_response_len_smaller_than_a_response() -> None:
    tensor = torch.nested.nested_tensor_from_jagged(torch.zeros(8), torch.tensor([0, 5, 8]))
    with raises(ShapeError, "'max_response_len'=1", "(2)"):
        impl.no_padding_2_padding(tensor, seed_batch(max_response_len=1))


def test_response_to_nested_too_narrow() -> None:
    with raises(ShapeError, "1 response columns", "2 tokens"):
        impl.response_to_nested(torch.zeros(2, 1), seed_batch()["response_mask"])


def test_left_right_bad_inputs() -> None:
    base = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.tensor([[1, 1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1]]), "position_ids": torch.tensor([[0, 1, 2, 3]])}
    with pytest.raises(KeyError, match="attention_mask"):
        impl.left_right_2_no_padding(TensorDict({k: v for k, v in base.items() if k != "attention_mask"},
                                                batch_size=[1]))
    holes = dict(base, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with raises(ShapeError, "strict=True", "not left-padded", "nested 'prompts'/'responses'"):
        impl.left_right_2_no_padding(TensorDict(holes, batch_size=[1]), strict=True)
    wide = dict(base, response_mask=torch.tensor([[1, 1, 1, 1, 1]]))
    with raises(BatchMismatchError, "'response_mask'", "(1, 5)"):
        impl.left_right_2_no_padding(TensorDict(wide, batch_size=[1]))
    no_prompt = dict(base, attention_mask=torch.tensor([[0, 0, 1, 1]]))
    with raises(ShapeError, "no prompt token", "prompt lengths [0]"):
        impl.left_right_2_no_padding(TensorDict(no_prompt, batch_size=[1]), strict=True)
    stray = dict(base, attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with raises(ShapeError, "'response_mask' marks 1 token(s)", "response lengths [1]"):
        impl.left_right_2_no_padding(TensorDict(stray, batch_size=[1]), strict=True)
    with pytest.warns(impl.LayoutWarning, match="marks 1 token"):
        out = impl.left_right_2_no_padding(TensorDict(stray, batch_size=[1]))
    assert out["loss_mask"].values().tolist() == [1]
    long_resp = dict(base, responses=torch.nested.nested_tensor_from_jagged(torch.ones(3), torch.tensor([0, 3])))
    with raises(ShapeError, "row of 3 tokens", "2 columns"):
        impl.left_right_2_no_padding(TensorDict(long_resp, batch_size=[1]))


def test_inputs_are_not_mutated_on_error() -> None:
    mb = seed_batch(pad_mode="right")
    before = mb["input_ids"].values().clone()
    with pytest.raises(UnsupportedConfigError):
        ENGINE.prepare_model_inputs(mb)
    assert torch.equal(mb["input_ids"].values(), before)


def test_response_count_differs_from_sequence_count() -> None:
    tensor = torch.nested.nested_tensor_from_jagged(torch.zeros(8), torch.tensor([0, 5, 8]))
    three = torch.nested.nested_tensor_from_jagged(torch.ones(3), torch.tensor([0, 1, 2, 3]))
    with raises(BatchMismatchError, "2 sequences", "3 responses"):
        impl.response_from_nested(tensor, three)
