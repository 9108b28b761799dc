"""The micro-batch reproducer's checks of what ``prepare_micro_batches`` and ``restore_dynamic_batch`` return
(INV-MB-001/002/003/004/006/007; :mod:`spec.repro.minibatch`): which samples each micro-batch holds, their tokens,
the token budget, forced groups, the fixed path's chunks, the restored order. The expected side comes from the case's
structure (``CASE``), never from the layer. Vendored after the layer's call (:mod:`.layer_call`) and the suite's
readings it uses (``micro_batch_rows``, ``check_sample_keys``)."""

from __future__ import annotations

import torch

#: what the file binds for this module: the case and which check, the layer's functions, the layer call's names and
#: the suite's readings (spec/cases/microbatch.py, spec/invariants/microbatch.py, written out)
BOUND = ("CASE", "CHECK", "cut", "context", "samples", "restore_dynamic_batch", "micro_batch_rows",
         "check_sample_keys")


def partition_problem(rows):
    flat = sorted(i for part in rows for i in part)
    if flat != list(range(CASE["batch_size"])):
        seen = [i for part in rows for i in part]
        dup = sorted({i for i in seen if seen.count(i) > 1})[:5]
        lost = sorted(set(range(CASE["batch_size"])) - set(seen))[:5]
        return (f"got micro-batch indices {str(rows)[:120]}: duplicated {dup}, missing {lost}; expected each of the "
                f"{CASE['batch_size']} samples in exactly one micro-batch")
    return None


def rows_problem(mini, micro, rows):
    want = samples(mini.get("input_ids"))
    for k, (mb, part) in enumerate(zip(micro, rows)):
        got = samples(mb.get("input_ids"))
        if len(got) != len(part):
            return f"micro-batch {k}: got {len(got)} samples, expected {len(part)} (its index list {part})"
        for j, (g, i) in enumerate(zip(got, part)):
            if not torch.equal(g, want[i]):
                return f"micro-batch {k}, sample {j}: got input_ids {g.tolist()[:12]}, expected sample {i}'s {want[i].tolist()[:12]}"
    return None


def tokens(mb):
    return int(mb.get("input_ids").offsets()[-1])


def count_problem(mini):
    if CASE["over_budget"]:
        print("NOT EXERCISED: a sample over the budget (INV-MB-003)")
        return None
    try:
        micro, indices = cut(mini)
    except ValueError as exc:
        if CASE["feasible"] is not True:
            return None  # no count within the groups meets the rules and the budget: a refusal is right
        return (f"refused with ValueError: {str(exc)[:300]}, expected micro-batches: a count within the "
                f"{CASE['num_groups']} groups meets the rules and the budget {CASE['budget']}")
    count = len(micro)
    sizes = [int(mb.batch_size[0]) if mb.batch_size else 0 for mb in micro]
    if CASE["min_num_micro_batch"] and count < CASE["min_num_micro_batch"]:
        return f"got {count} micro-batches, expected at least min_num_micro_batch={CASE['min_num_micro_batch']}"
    if CASE["num_batches_divided_by"] and count % CASE["num_batches_divided_by"]:
        return f"got {count} micro-batches, expected a multiple of num_batches_divided_by={CASE['num_batches_divided_by']}"
    needed = CASE["required_count"]
    if CASE["total_nnz"] <= CASE["budget"] and count != max(needed, 1) and needed <= CASE["num_groups"]:
        return (f"got {count} micro-batches (sizes {sizes[:8]}), expected {needed}: the whole mini-batch "
                f"({CASE['total_nnz']} tokens) fits the budget {CASE['budget']}")
    empty = [k for k, n in enumerate(sizes) if n == 0]
    if empty and CASE["feasible"] is True:
        return f"micro-batches {empty[:5]} are empty, expected none: the {CASE['num_groups']} groups fill {count}"
    return None


def check(mini):
    if CHECK == "count":
        return count_problem(mini)
    refusable = CASE["refusable"]
    if CHECK in ("budget", "fixed"):
        word = "max_token_len" if CHECK == "budget" else "micro_batch_size"
        must_refuse = CASE["over_budget"] if CHECK == "budget" else not CASE["fixed_divides"]
        try:
            micro, indices = cut(mini)
        except Exception as exc:  # noqa: BLE001
            if must_refuse and word in str(exc):
                return None
            if must_refuse:
                return f"refused with {type(exc).__name__}: {exc}, expected an error naming {word}"
            if refusable:
                return None
            return f"got {type(exc).__name__}: {exc}, expected micro-batches (every sample or group fits)"
        if must_refuse:
            return f"got {len(micro)} micro-batches, expected a refusal naming {word}"
        if CHECK == "budget":
            over = [(k, tokens(mb)) for k, mb in enumerate(micro) if tokens(mb) > CASE["budget"]]
            return (f"micro-batch {over[0][0]} holds {over[0][1]} tokens, expected at most the budget {CASE['budget']}"
                    if over else None)
        size = CASE["micro_batch_size"] * CASE["force_group_size"]
        sizes = [int(mb.batch_size[0]) for mb in micro]
        if indices is not None:
            return f"got indices {indices!r:.80}, expected None (the fixed path keeps the order)"
        if sizes != [size] * (CASE["batch_size"] // size):
            return f"micro-batch sizes {sizes[:8]}, expected {CASE['batch_size'] // size} of {size}"
        for k, mb in enumerate(micro):  # every key of its samples, as INV-MB-006 checks it (layouts included)
            check_sample_keys(mb, mini, list(range(k * size, (k + 1) * size)), f"micro-batch {k}")
        return None
    if refusable:
        print("NOT EXERCISED: the layer may refuse this mini-batch")
        return None
    micro, indices = cut(mini)
    if indices is None:
        return "got no batch_idx_list from the dynamic path, expected one index list per micro-batch"
    rows = micro_batch_rows(micro, indices)
    problem = partition_problem(rows) or rows_problem(mini, micro, rows)
    if problem or CHECK == "partition":
        return problem
    if CHECK == "groups":
        g = CASE["force_group_size"]
        where = {i: k for k, part in enumerate(rows) for i in part}
        for start in range(0, CASE["batch_size"], g):
            homes = sorted({where[i] for i in range(start, start + g)})
            if len(homes) > 1:
                return f"group {start}..{start + g - 1} split across micro-batches {homes}, expected one"
        return None
    parts = [t for mb in micro for t in samples(mb.get("input_ids"))]  # restore
    joined = torch.nested.nested_tensor_from_jagged(torch.cat(parts), torch.tensor([0] + [t.shape[0] for t in parts]).cumsum(0))
    with context():
        back = restore_dynamic_batch(joined, indices)
    want = samples(mini.get("input_ids"))
    for i, (g, w) in enumerate(zip(samples(back), want)):
        if not torch.equal(g, w):
            return f"restored sample {i}: got {g.tolist()[:12]}, expected {w.tolist()[:12]}"
    return None
