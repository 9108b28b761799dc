"""Planted bugs in reading flags and engine settings, and in the slice helpers' dtypes."""

from __future__ import annotations

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
