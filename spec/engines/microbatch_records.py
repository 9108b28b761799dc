"""Known failures of verl's micro-batch layer (``INV-MB-*``), as precise records.

Keyed by verl version (``"*"``: every version probed so far, 0.9.1); each record names the cases it applies to (a
:class:`spec.protocol.known.When` on the :class:`spec.cases.microbatch.MiniBatchCase`) and how it fails, with the
upstream issue where one is known. docs/verl-conformance.md ("The micro-batch layer") has a minimal counterexample
for each.
"""

from __future__ import annotations

from ..protocol.known import KnownFailure, When

__all__ = ["MICROBATCH_RECORDS", "MROPE", "SOME_KEY_OF_ONE_SHAPE"]

#: mRoPE position ids: nested (B, 4, j), ragged at dim 2
MROPE = When("mRoPE position_ids (B, 4, j) in the mini-batch", lambda c: bool(getattr(c, "mrope", False)))
#: list_of_dict_to_tensordict's equal-shape test fires for some key: all sequences of one length (input_ids,
#: position_ids, ...) or all responses of one length (responses), B = 1 included
SOME_KEY_OF_ONE_SHAPE = When(
    "all sequence lengths equal or all response lengths equal (B = 1 included)",
    lambda c: len(set(c.seq_lens)) == 1 or len(set(c.response_lens)) == 1)

_MROPE_SHAPE = (r"position_ids.*: size j\d+ at dim 1, expected 4 \(shape \(\d+, j\d+, \d+\), the mini-batch's "
                r"\(\d+, 4, j\d+\)\)")
_MROPE_REASON = (
    "nested_tensor_from_tensor_list builds (4, n) items with ragged_idx=2 as nested_tensor_from_jagged(values of "
    "(4, total), offsets) -- ragged at dim 1 -- and then sets _ragged_idx = 2 by hand: values and offsets are right "
    "but the tensor's shape reads (B, j, total) instead of (B, 4, j). Every operation that rebuilds nested tensors "
    "through it (index_select_tensor_dict, chunk_tensordict, concat_nested_tensors / concat_tensordict, and so "
    "prepare_micro_batches on both paths) hands the engine mRoPE position_ids whose size(1) is a ragged j, not 4; "
    "verl bug (the layout family of verl #7899, in tensordict_utils), harmless to an engine that reads only "
    "values() and offsets() (INV-MB-015 passes), wrong for one that reads the shape")

#: version -> records (as verl's KNOWN_BUGS: a fact about that release). Measured on 0.9.1; verl 0.7.1's layer
#: does not build mRoPE positions with the hand-set ragged dim (its INV-MB-006 runs under mRoPE pass).
MICROBATCH_RECORDS: dict[str, tuple[KnownFailure, ...]] = {
    "0.9.1": (
        *(KnownFailure(inv, f"{_MROPE_REASON} [{what}]", raises=AssertionError, matches=_MROPE_SHAPE, when=MROPE)
          for inv, what in (("INV-MB-006", "chunk_tensordict on the fixed path"),
                            ("INV-MB-008", "index_select_tensor_dict / chunk_tensordict in prepare_micro_batches"),
                            ("INV-MB-009", "chunk_tensordict"),
                            ("INV-MB-010", "concat_tensordict"),
                            ("INV-MB-011", "index_select_tensor_dict"),
                            ("INV-MB-012", "nested_tensor_from_tensor_list / concat_nested_tensors"),
                            ("INV-MB-014", "maybe_fix_3d_position_ids keeps the hand-set _ragged_idx"))),
        KnownFailure(
            "INV-MB-013", "list_of_dict_to_tensordict stacks a key into a dense tensor whenever every sample's tensor "
            "has the same shape (all lengths equal, or B = 1): a GRPO group whose responses all hit the maximum length "
            "gets dense ids/responses and .offsets() fails downstream; verl bug #7661 (open at 0.9.1's release), "
            "reproduced through the layer", raises=AssertionError, when=SOME_KEY_OF_ONE_SHAPE,
            matches=r"built from \d+ samples: \(\d+(, \d+)*\) \(dense\), expected a nested \(jagged\) tensor"),
    ),
}
