"""The micro-batch reproducer's checks of what ``prepare_micro_batches`` and ``restore_dynamic_batch`` return
(INV-MB-001/002/003/004/006/007; :mod:`spec.repro.minibatch`): the invariants' own checks (spec/truth/microbatch_checks.py,
written out into the file) on the layer's returns, the expected side from the case's structure (``CASE``), never from
the layer. Vendored after the layer's call (:mod:`.layer_call`) and the checks."""

from __future__ import annotations

#: what the file binds for this module: the case and which check, the layer's functions, the layer call's names and
#: the invariants' checks (spec/cases/microbatch.py, spec/truth/microbatch_checks.py, written out)
BOUND = ("CASE", "CHECK", "cut", "context", "restore_dynamic_batch", "micro_batch_rows", "check_index_lists",
         "check_partition", "micro_batch_samples", "groups_together", "token_budget", "count_rules", "fixed_size",
         "restore_order")


def not_exercised(reason):
    print(f"NOT EXERCISED: {reason}")


def check(mini):
    """The invariant ``CHECK``'s check on ``mini``: None when the layer is right (a failed check raises)."""
    if CHECK == "budget":
        token_budget(lambda: cut(mini), CASE["over_budget"], CASE["feasible"], CASE["budget"], CASE["longest_group"],
                     CASE["max_token_len"], CASE["sp_size"], not_exercised)
    elif CHECK == "count":
        if CASE["over_budget"]:
            not_exercised("a sample over the budget (INV-MB-003)")
            return None
        count_rules(lambda: cut(mini), CASE["feasible"], CASE["required_count"], CASE["num_groups"], CASE["budget"],
                    CASE["longest_group"], CASE["total_nnz"], CASE["min_num_micro_batch"],
                    CASE["num_batches_divided_by"])
    elif CHECK == "fixed":
        fixed_size(lambda: cut(mini), mini, CASE["fixed_divides"], CASE["batch_size"], CASE["micro_batch_size"],
                   CASE["force_group_size"])
    elif CASE["refusable"]:
        not_exercised("the layer may refuse this mini-batch (INV-MB-003/004/006)")
    else:
        micro, indices = cut(mini)
        rows = micro_batch_rows(micro, indices)
        check_index_lists(micro, rows, indices, dynamic=CHECK == "partition")
        check_partition(CASE["batch_size"], rows)
        if CHECK == "partition":
            micro_batch_samples(mini, micro, rows)
        elif CHECK == "groups":
            if CASE["force_group_size"] == 1:
                not_exercised("force_group_size = 1")
            groups_together(CASE["batch_size"], CASE["force_group_size"], rows)
        else:
            with context():
                restore_order(restore_dynamic_batch, mini, micro, indices)
    return None
