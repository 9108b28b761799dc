"""Known failures of verl's micro-batch layer (``INV-MB-*``), as precise records.

Keyed by verl version (``"*"``: every version probed so far; 0.9.1 and 0.7.1 each have their own); each record names the cases it applies to (a
:class:`spec.protocol.known.When` on the :class:`spec.cases.microbatch.MiniBatchCase`) and how it fails, with the
upstream issue where one is known. spec/engines/verl/README.md ("The micro-batch layer") has a minimal counterexample
for each.
"""

from __future__ import annotations

from ...protocol.known import KnownFailure, When

__all__ = ["MICROBATCH_RECORDS", "MROPE", "SOME_KEY_OF_ONE_SHAPE", "COUNT_OVER_GROUPS", "DYNAMIC_SEVERAL",
           "GROUP_OVER_BUDGET"]

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


def _count_over_groups(c) -> bool:
    """verl 0.7.1's micro-batch count exceeds some rank's groups: its count per rank is
    max(min_num_micro_batch, min(groups, ceil(total / budget))), rounded up to num_batches_divided_by, the largest
    over the data-parallel ranks (same_micro_num_in_dp); a count above a rank's groups trips its bare
    ``assert num_micro_batches <= num_groups``."""
    if not getattr(c, "use_dynamic_bsz", False):
        return False
    ranks = [c.rank_case(r) for r in range(c.world)]
    step = c.num_batches_divided_by or 1
    count = max(max(c.min_num_micro_batch or 0, min(rc.num_groups, -(-rc.total_nnz // rc.budget))) for rc in ranks)
    return -(-count // step) * step > min(rc.num_groups for rc in ranks)


#: the count exceeds a rank's groups (min_num_micro_batch, num_batches_divided_by or a data-parallel peer ask more)
COUNT_OVER_GROUPS = When("the micro-batch count verl 0.7.1 computes (min_num_micro_batch, the num_batches_divided_by "
                         "round-up, the largest over data-parallel ranks) exceeds a rank's samples (groups)",
                         _count_over_groups)
#: the dynamic path with two or more groups: a balanced partition into ceil(total / budget) micro-batches may overflow
DYNAMIC_SEVERAL = When("use_dynamic_bsz with two or more samples (groups)",
                       lambda c: bool(getattr(c, "use_dynamic_bsz", False)) and c.num_groups >= 2)

#: a forced group (force_group_size > 1) over the budget whose every sample fits it
GROUP_OVER_BUDGET = When("a forced group over the budget, each of its samples within it",
                         lambda c: c.force_group_size > 1 and c.over_budget and max(c.seq_lens) <= c.budget)

_MROPE_071 = r"'position_ids': ragged at dim 1, expected dim 2"
_MROPE_071_MODEL = (r"the engine's model inputs \(rank \d+\): position_ids of shape \(\d+, \d+, \d+\) for input_ids "
                    r"of shape")
_MROPE_071_REASON = (
    "verl 0.7.1's chunk_tensordict / index_select_tensor_dict / concat_nested_tensors rebuild a nested key with "
    "torch.nested.as_nested_tensor(list of per-sample tensors, layout=torch.jagged), which is ragged at dim 1: an "
    "mRoPE sample's (4, n) position ids come back ragged over the 4 axes (values (4 B, n) when the lengths are "
    "equal), not over its tokens; only maybe_fix_3d_position_ids' hand-set _ragged_idx = 2 relabels them. 0.9.1 "
    "rebuilds through nested_tensor_from_tensor_list(ragged_idx=2) (its own record: the shape reads (B, j, total)). "
    "The layout family of verl #7899")

#: version -> records (as verl's KNOWN_BUGS: a fact about that release), each measured on that release.
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
    "0.7.1": (
        *(KnownFailure(inv, f"{_MROPE_071_REASON} [{what}]", raises=AssertionError, matches=_MROPE_071, when=MROPE)
          for inv, what in (("INV-MB-006", "chunk_tensordict on the fixed path"),
                            ("INV-MB-008", "index_select_tensor_dict / chunk_tensordict in prepare_micro_batches"),
                            ("INV-MB-009", "chunk_tensordict"),
                            ("INV-MB-010", "concat_tensordict"),
                            ("INV-MB-011", "index_select_tensor_dict"))),
        KnownFailure("INV-MB-014", f"{_MROPE_071_REASON} [maybe_fix_3d_position_ids relabels the dim by hand: the "
                     "shape then reads (B, j, n)]", raises=AssertionError, matches=_MROPE_SHAPE, when=MROPE),
        KnownFailure("INV-MB-015", f"{_MROPE_071_REASON} [the engine then hands the model position ids of the wrong "
                     "shape: (4 B, 1, n) for ids (1, n), in both modes]", raises=AssertionError,
                     matches=_MROPE_071_MODEL, when=MROPE, certain=False),
        *(KnownFailure(
            inv, "rearrange_micro_batches takes ceil(total tokens / max_token_len) micro-batches, a lower bound, and "
            "balances their workloads (sum of squared lengths) without checking the budget: a micro-batch can hold "
            f"more than max_token_len tokens (by less than one sample) [{where}]. verl 0.9.1 raises the count until "
            "every micro-batch fits", raises=AssertionError, when=DYNAMIC_SEVERAL, certain=False, matches=matches)
          for inv, where, matches in (
              ("INV-MB-003", "one rank", r"micro-batch \d+ holds \d+ tokens, over the budget \d+"),
              ("INV-MB-005", "each data-parallel rank",
               r"rank \d+: micro-batches of \[[\d, ]+\] tokens, over the budget \d+"))),
        KnownFailure(
            "INV-MB-003", "rearrange_micro_batches checks only that each sample fits max_token_len (`assert "
            "max_token_len >= max_seq_len`), not each forced group: a group over the budget is accepted, and its "
            "micro-batch overflows; verl 0.9.1 raises a ValueError naming the group (A forced group exceeds "
            "max_token_len)", raises=AssertionError, when=GROUP_OVER_BUDGET,
            matches=r"accepted a sample \(group\) of \d+ tokens over the budget \d+"),
        *(KnownFailure(
            inv, "rearrange_micro_batches refuses a count above the groups with a bare `assert num_micro_batches <= "
            f"num_groups` (an AssertionError without a message, gone under python -O) [{what}]; verl 0.9.1 raises a "
            "ValueError that names the count and the groups", raises=AssertionError, when=COUNT_OVER_GROUPS,
            matches=r"^AssertionError: ?$")
          for inv, what in (("INV-MB-004", "min_num_micro_batch / num_batches_divided_by"),
                            ("INV-MB-005", "a data-parallel peer needs more micro-batches"))),
        KnownFailure(
            "INV-MB-003", "rearrange_micro_batches refuses a count above the groups with a bare `assert "
            "num_micro_batches <= num_groups` before it looks at a forced group over the budget: the mini-batch is "
            "refused, by an AssertionError that names neither max_token_len nor the group; verl 0.9.1 raises a "
            "ValueError naming the group", raises=AssertionError, when=GROUP_OVER_BUDGET & COUNT_OVER_GROUPS,
            matches=r"refused a sample over the budget with AssertionError: *\(the message must name max_token_len\)"),
    ),
}
