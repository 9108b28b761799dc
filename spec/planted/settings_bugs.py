"""Planted bugs in reading flags and engine settings, and in the slice helpers' dtypes."""

from __future__ import annotations

import torch
from tensordict import TensorDict

import impl

_BOOL_FLAGS = ("use_remove_padding", "use_fused_kernels", "calculate_entropy", "calculate_sum_pi_squared",
               "distillation_use_topk", "distillation_only")


def _with_flags(mb, **flags):
    """A shallow copy of the micro-batch with ``flags`` set (the caller's batch is untouched)."""
    out = mb.copy()
    for key, value in flags.items():
        out.set_non_tensor(key, value)
    return out


def _flag(mb, key):
    value = mb.get(key)
    return getattr(value, "data", value)


class EntropyFlagDefaultsTrue(impl.LMHeadEngine):
    """A missing calculate_entropy flag is read with default True (entropy computed unasked)."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        if "calculate_entropy" not in mb.keys():
            mb = _with_flags(mb, calculate_entropy=True)
        return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **kw)


def _is_true(mb):
    """use_remove_padding tested with ``is True``: 1 or numpy.True_ reads as padded."""
    if "use_remove_padding" in mb.keys() and _flag(mb, "use_remove_padding") is not True:
        return _with_flags(mb, use_remove_padding=False)
    return mb


class RemovePaddingIsTrue(impl.LMHeadEngine):
    """use_remove_padding is tested with ``is True``, so a 0/1 int or a numpy bool means padded."""

    def prepare_model_inputs(self, mb):
        return super().prepare_model_inputs(_is_true(mb))

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        return super().prepare_model_outputs(output, output_args, _is_true(mb), logits_processor_func, **kw)


def _truthy(mb):
    present = {key: bool(_flag(mb, key)) for key in _BOOL_FLAGS if key in mb.keys()}
    return _with_flags(mb, **present)


class FlagsByTruthiness(impl.LMHeadEngine):
    """Bool flags are read by truthiness: the string "False" turns a feature on, None turns it off."""

    def prepare_model_inputs(self, mb):
        return super().prepare_model_inputs(_truthy(mb))

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **kw):
        return super().prepare_model_outputs(output, output_args, _truthy(mb), logits_processor_func, **kw)


class ChunkSizeOrNone(impl.LMHeadEngine):
    """The constructor reads ``entropy_chunk_size or None`` (and drops a negative one): 0 or -1 pass silently."""

    def __init__(self, *, sp_size=1, sp_rank=0, entropy_chunk_size=None, **settings):
        chunk = entropy_chunk_size if entropy_chunk_size and entropy_chunk_size > 0 else None
        super().__init__(sp_size=sp_size, sp_rank=sp_rank, entropy_chunk_size=chunk, **settings)


def slice_through_float(tensor, data):
    """no_padding_2_padding converts every per-token tensor to float32 (bool masks come back as floats)."""
    values = tensor if tensor.is_floating_point() else tensor.float()
    return impl.no_padding_2_padding(values, data)


def dense_lengths_from_mask_sum(tensor, data):
    """no_padding_2_padding on a dense batch counts response tokens as response_mask.sum() (holes shorten r_i)."""
    responses = data.get("responses", None) if "responses" in data.keys() else None
    if isinstance(responses, torch.Tensor) and not responses.is_nested and "response_mask" in data.keys():
        lens = data["response_mask"].sum(-1).clamp(min=1)
        prompt = data["attention_mask"][:, : data["attention_mask"].shape[1] - responses.shape[1]].sum(-1)
        view = TensorDict({
            "prompts": torch.nested.nested_tensor_from_jagged(torch.zeros(int(prompt.sum())),
                                                              torch.nn.functional.pad(prompt.cumsum(0), (1, 0))),
            "responses": torch.nested.nested_tensor_from_jagged(torch.zeros(int(lens.sum())),
                                                                torch.nn.functional.pad(lens.cumsum(0), (1, 0))),
        }, batch_size=[responses.shape[0]])
        ends = (prompt + data["attention_mask"][:, -responses.shape[1]:].sum(-1)).cumsum(0)
        values = tensor.values() if tensor.is_nested else tensor
        starts = torch.nn.functional.pad(ends[:-1], (1, 0))
        # the model output re-cut to the shortened sequences: each keeps its first p_i + len_i tokens
        keep = torch.cat([values[s: s + p + n] for s, p, n in zip(starts.tolist(), prompt.tolist(), lens.tolist())])
        kept = torch.nested.nested_tensor_from_jagged(keep, torch.nn.functional.pad((prompt + lens).cumsum(0), (1, 0)))
        return impl.no_padding_2_padding(kept, view)
    return impl.no_padding_2_padding(tensor, data)


class OutputsIgnorePadMode(impl.LMHeadEngine):
    """prepare_model_outputs reads every micro-batch as no_padding (it trusts prepare_model_inputs to have checked
    pad_mode): called alone with a left_right or right micro-batch it returns tensors instead of refusing."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        return super().prepare_model_outputs(output, oa, _with_flags(mb, pad_mode="no_padding"),
                                             logits_processor_func, **kw)


class ValueOutputsIgnorePadMode(impl.ValueHeadEngine):
    """The value head's prepare_model_outputs reads every micro-batch as no_padding (as
    :class:`OutputsIgnorePadMode`)."""

    def prepare_model_outputs(self, output, oa, mb, *args, **kw):
        return super().prepare_model_outputs(output, oa, _with_flags(mb, pad_mode="no_padding"), *args, **kw)


class FusedDistillationDropped(impl.LMHeadEngine):
    """With fused kernels the outputs step returns the model's log-probs and entropy and stops: the top-K
    distillation terms are silently missing (a fused-kernel distillation run trains on nothing)."""

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        out = super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)
        if _flag(mb, "use_fused_kernels"):
            out = {k: v for k, v in out.items() if k in ("log_probs", "entropy")}
        return out
