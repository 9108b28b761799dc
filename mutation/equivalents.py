"""Surviving mutants that no test can kill, each with the reason, reviewed by hand (docs/mutation.md).

A mutant is equivalent when no input the contract allows can tell it from impl: the change only
touches the text of an error message, or a choice that changes speed or memory and never a value.
Entries are exact mutmut names (they stay valid while the function is unchanged: mutmut numbers a
function's mutants in source order); a changed function's mutants must be reviewed again.
"""

from __future__ import annotations

from fnmatch import fnmatch

__all__ = ["EQUIVALENT", "DEVICE_ONLY", "MESSAGE", "ON_CPU", "SPEED", "classify"]

MESSAGE = "only the text of an error message changes (the key/mode string is never read otherwise)"
SPEED = "only the chunking of the work changes (memory and speed), never a value"

#: mutants that only drop a ``device=`` argument (or pass None): the tensor is made on the default
#: device, the CPU, so on a CPU-only run nothing changes; INV-DEV-001/002 on a CUDA device kill them.
#: Found by a rule over all 2016 mutants (the removed/None argument is a device and nothing else
#: changes); no GPU was lent to this work, so they are counted as equivalent on CPU, not killed.
DEVICE_ONLY = (
    "impl.dense.x_jagged_to_padded__mutmut_7",
    "impl.dense.x_padded_to_jagged__mutmut_2",
    "impl.dense.x_rows_and_positions__mutmut_11",
    "impl.dense.x_rows_and_positions__mutmut_16",
    "impl.dense.x_rows_and_positions__mutmut_18",
    "impl.dense.x_rows_and_positions__mutmut_9",
    "impl.inputs.x_prepare_model_inputs__mutmut_52",
    "impl.inputs.x_prepare_model_inputs__mutmut_56",
    "impl.layout.x_nested_from_values__mutmut_7",
    "impl.layout.xǁSequenceLayoutǁmask__mutmut_11",
    "impl.layout.xǁSequenceLayoutǁmask__mutmut_9",
    "impl.layout.xǁSequenceLayoutǁof__mutmut_12",
    "impl.layout.xǁSequenceLayoutǁper_token__mutmut_9",
    "impl.logits.x_sample_temperature__mutmut_13",
    "impl.logits.x_sample_temperature__mutmut_23",
    "impl.logits.x_sample_temperature__mutmut_9",
    "impl.outputs.x_prepare_model_outputs__mutmut_62",
    "impl.padding.x__runs__mutmut_15",
    "impl.padding.x__runs__mutmut_17",
    "impl.padding.x__values_and_offsets__mutmut_20",
    "impl.padding.x_left_right_2_no_padding__mutmut_113",
    "impl.padding.x_left_right_2_no_padding__mutmut_115",
    "impl.padding.x_left_right_2_no_padding__mutmut_80",
    "impl.padding.x_left_right_2_no_padding__mutmut_82",
    "impl.padding.x_no_padding_2_padding__mutmut_56",
    "impl.padding.x_no_padding_2_padding__mutmut_58",
    "impl.padding.x_response_lengths__mutmut_15",
    "impl.padding.x_response_lengths__mutmut_33",
    "impl.padding.x_response_to_nested__mutmut_24",
    "impl.sequence_parallel.xǁRowPlanǁshard__mutmut_11",
)
ON_CPU = "equivalent on CPU only: drops a device argument (a CUDA run of INV-DEV-001/002 kills it)"

#: mutmut mutant name (or fnmatch glob) -> why it is equivalent
EQUIVALENT: dict[str, str] = {
    "impl.inputs.x_rolled_labels__mutmut_3":
        "torch.roll(ids, -1, dims=None) flattens, rolls and restores the shape: the packed ids are 1-D",
    "impl.logits.x__chunk_bounds__mutmut_9": SPEED + " (range step 1: one row per chunk)",
    "impl.outputs.x_prepare_model_outputs__mutmut_127": MESSAGE,
    "impl.outputs.xǁTokenRouteǁcheck__mutmut_19": MESSAGE,
    "impl.padding.x_response_lengths__mutmut_17": MESSAGE,
    "impl.padding.x_response_to_nested__mutmut_3": MESSAGE,
    **{name: ON_CPU for name in DEVICE_ONLY},
}


def classify(name: str) -> str | None:
    """The reason ``name`` is equivalent, or None."""
    for pattern, reason in EQUIVALENT.items():
        if name == pattern or fnmatch(name, pattern):
            return reason
    return None
