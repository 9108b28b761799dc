"""The micro-batch reproducer's checks of the layer's TensorDict helpers (INV-MB-008 .. INV-MB-014;
:mod:`spec.repro.layer_helpers`): each helper called in the case's autograd context, its result read with the suite's
own readings (``check_sample_keys``, ``check_nested``, ``same``: spec/invariants/microbatch.py, written out) against
the saved mini-batch. Which parts, chunk count and selection come from the case's seed, written out as data
(``CASE``). Vendored after the layer's call (:mod:`.layer_call`) and the readings."""

from __future__ import annotations

import pickle

import torch
from tensordict import TensorDict

#: what the file binds for this module: the case and which check, the layer's helpers, the layer call's names and
#: the suite's readings (spec/cases/microbatch.py, spec/invariants/microbatch.py, spec/invariants/core.py, written out)
BOUND = ("CASE", "CHECK", "cut", "context", "micro_batch_rows", "chunk_tensordict", "concat_tensordict",
         "index_select_tensor_dict", "nested_tensor_from_tensor_list", "concat_nested_tensors",
         "list_of_dict_to_tensordict", "maybe_fix_3d_position_ids", "check_sample_keys", "check_nested", "same", "held",
         "_snapshot", "_select", "items", "postprocess_batch_func", "check_index_lists", "check_partition",
         "training_step_outputs", "padded_cut", "padded_helpers")


def check(mini):
    B = CASE["batch_size"]
    every = list(range(B))
    if CHECK in ("step_outputs", "padded_cut"):  # INV-MB-017/018: the layer's cut of the (padded) mini-batch, then
        if CASE["refusable"]:
            print("NOT EXERCISED: the layer may refuse this mini-batch (INV-MB-003/004/006)")
            return None
        micro, indices = cut(mini)
        rows = micro_batch_rows(micro, indices)
        check_index_lists(micro, rows, indices)
        check_partition(B, rows)
        if CHECK == "padded_cut":  # every key's rows those of its samples, the attention mask within the budget
            padded_cut(mini, micro, rows, CASE["use_dynamic_bsz"], CASE["budget"])
        else:  # a training step's outputs through postprocess_batch_func
            with context():
                training_step_outputs(postprocess_batch_func, mini, micro, indices, rows, CASE["outputs"])
        return None
    if CHECK == "padded_helpers":  # INV-MB-019: concat and index_select on padded and metadata-only TensorDicts
        parts = [_select(mini, rows) for rows in CASE["parts"]]
        with context():
            padded_helpers(concat_tensordict, index_select_tensor_dict, mini, parts, CASE["parts"], CASE["seed"])
        return None
    if CHECK == "keys":  # INV-MB-008: every key, layout and flag in every micro-batch; the mini-batch unchanged
        if CASE["refusable"]:
            print("NOT EXERCISED: the layer may refuse this mini-batch (INV-MB-003/004/006)")
            return None
        before = _snapshot(mini)
        micro, indices = cut(mini)
        after = _snapshot(mini)
        changed = [key for key in before if key not in after or not same(after[key], before[key])]
        if changed or set(after) != set(before):
            return f"the mini-batch: got keys {changed or sorted(set(after) ^ set(before))} changed, expected it unchanged"
        rows = micro_batch_rows(micro, indices)
        if len(rows) != len(micro):
            return f"got {len(micro)} micro-batches but {len(rows)} index lists, expected one per micro-batch"
        for k, (mb, part) in enumerate(zip(micro, rows)):
            check_sample_keys(mb, mini, part, f"micro-batch {k}")
        return None
    if CHECK == "chunk":
        chunks = CASE["chunks"]
        with context():
            parts = list(chunk_tensordict(mini, chunks))
        if len(parts) != chunks:
            return f"chunk_tensordict(td of {B}, {chunks}): got {len(parts)} chunks, expected {chunks}"
        size = B // chunks
        for k, part in enumerate(parts):
            check_sample_keys(part, mini, list(range(k * size, (k + 1) * size)), f"chunk {k} of {chunks}")
        return None
    if CHECK == "concat":
        parts = [_select(mini, rows) for rows in CASE["parts"]]
        with context():
            got = concat_tensordict(parts)
        check_sample_keys(got, mini, every, f"concat of parts {[len(r) for r in CASE['parts']]}")
        return None
    if CHECK == "index_select":
        rows = CASE["selection"]
        with context():
            got = index_select_tensor_dict(mini, rows)
        check_sample_keys(got, mini, rows, f"index_select of {rows[:8]}")
        return None
    if CHECK == "nested":
        for key in CASE["nested_keys"]:
            if key not in mini.keys():
                continue
            want = mini.get(key)
            ragged = getattr(want, "_ragged_idx", 1)
            with context():
                built = nested_tensor_from_tensor_list([t.clone() for t in items(want, key)], ragged_idx=ragged)
            check_nested(built, want, every, f"nested_tensor_from_tensor_list({key!r} items, ragged_idx={ragged})")
            if want.dim() >= 2:
                halves = [_select(mini, rows).get(key) for rows in CASE["halves"]]
                with context():
                    joined = concat_nested_tensors(halves)
                check_nested(joined, want, every, f"concat_nested_tensors({key!r} halves)")
        return None
    if CHECK == "from_samples":
        keys = [k for k in ("input_ids", "position_ids", "responses", "teacher_ids", "routed_experts") if k in mini.keys()]
        per_key = {k: items(mini.get(k), k) for k in keys}
        dicts = [{**{k: per_key[k][i].clone() for k in keys}, "score": torch.tensor(float(i)), "uid": f"u{i}"}
                 for i in every]
        with context():
            got = list_of_dict_to_tensordict(dicts)
        if tuple(got.batch_size)[:1] != (B,):
            return f"got batch_size {tuple(got.batch_size)}, expected ({B},)"
        for key in dicts[0]:
            value = got.get(key)
            if key == "score":
                want = torch.tensor([float(i) for i in every])
                if not isinstance(value, torch.Tensor) or value.is_nested or not torch.equal(value, want):
                    return f"'score' (0-d per sample): got {value!r:.100}, expected the dense (B,) {want.tolist()[:8]}"
            elif key == "uid":
                got_uids = value.tolist() if hasattr(value, "tolist") else value
                if got_uids != [f"u{i}" for i in every]:
                    return f"'uid': got {got_uids!r:.100}, expected the samples' uids in order"
            else:
                check_nested(value, mini.get(key), every, f"{key!r} built from {B} samples")
        return None
    # fix_3d: a consolidate + pickle round trip (a batch that crossed a process boundary), then the fix
    tensors = TensorDict({k: mini.get(k) for k in mini.keys() if isinstance(mini.get(k), torch.Tensor)},
                         batch_size=mini.batch_size)
    try:
        moved = pickle.loads(pickle.dumps(tensors.consolidate()))
    except Exception as exc:  # noqa: BLE001 - this tensordict cannot round-trip nested tensors
        print(f"NOT EXERCISED: consolidate/pickle unavailable here: {type(exc).__name__}")
        return None
    others = {k: held(moved.get(k)) for k in moved.keys() if k != "position_ids" or not CASE["mrope"]}
    with context():
        maybe_fix_3d_position_ids(moved)
    check_nested(moved.get("position_ids"), mini.get("position_ids"), every, "position_ids after the round trip and fix")
    for key, before in others.items():
        if not same(held(moved.get(key)), before):
            return f"{key!r}: changed by maybe_fix_3d_position_ids, expected it left as it was"
    return None
