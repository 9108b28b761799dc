"""Standalone checks of the micro-batch layer's TensorDict helpers (INV-MB-009 .. INV-MB-014), written into the
micro-batch reproducers by :mod:`.minibatch`.

What each reproducer calls is the layer's own helper, imported by module and name: ``chunk_tensordict``,
``concat_tensordict``, ``index_select_tensor_dict``, ``nested_tensor_from_tensor_list`` with
``concat_nested_tensors``, ``list_of_dict_to_tensordict``, ``maybe_fix_3d_position_ids``. What it checks is what
the invariant states a consumer reads: every key of the mini-batch for the samples asked (nested values by their
own offsets, the ragged dim and the non-ragged sizes, dense rows, per-sample stacks, flags). The expected side
is the saved mini-batch itself, cut by the file's own plain-torch ``select`` where parts are needed; which parts,
which chunk count and which selection come from the case's seed, computed here and written out as data.
"""

from __future__ import annotations

from typing import Any

import inspect

from ..cases.microbatch import MiniBatchCase, materialize_minibatch
from ..execute.handoff import nested_parts
from ..invariants.core import held, same
from ..invariants.microbatch import (NESTED_KEYS, _chunk_count, _halves, _is_stack, _items, _offsets, _plain, _select,
                                     _selection, _short, _snapshot, _suite_parts, check_nested, check_sample_keys)

__all__ = ["HELPER_CHECKS", "helper_case_data", "HELPER_RUNTIME", "READINGS"]

#: invariant -> (the layer functions it calls, the check in :data:`HELPER_RUNTIME`)
HELPER_CHECKS: dict[str, tuple[tuple[str, ...], str]] = {
    "INV-MB-008": (("prepare_micro_batches",), "keys"),
    "INV-MB-009": (("chunk_tensordict",), "chunk"),
    "INV-MB-010": (("concat_tensordict",), "concat"),
    "INV-MB-011": (("index_select_tensor_dict",), "index_select"),
    "INV-MB-012": (("nested_tensor_from_tensor_list", "concat_nested_tensors"), "nested"),
    "INV-MB-013": (("list_of_dict_to_tensordict",), "from_samples"),
    "INV-MB-014": (("maybe_fix_3d_position_ids",), "fix_3d"),
}


def helper_case_data(case: MiniBatchCase) -> dict[str, Any]:
    """The seed-drawn structure the helper checks use, as plain values (what the suite's invariants draw)."""
    return {"chunks": _chunk_count(case), "parts": [rows for _, rows in _suite_parts(materialize_minibatch(case), case)],
            "selection": _selection(case), "halves": _halves(case.batch_size), "mrope": case.mrope,
            "nested_keys": list(NESTED_KEYS)}


def _written_out() -> str:
    """The suite's own readings, verbatim (pure torch/tensordict): what a consumer reads of a nested tensor or a
    TensorDict, and the invariants' comparisons (``fail`` raises the file's ``Wrong``)."""
    functions = (_items, _short, check_nested, check_sample_keys, _is_stack, _plain, _offsets, _select, nested_parts,
                 held, same, _snapshot)
    return "\n\ndef fail(message):\n    raise Wrong(message)\n\n\n" + "\n\n".join(
        inspect.getsource(fn) for fn in functions)


#: the suite's readings of nested tensors and TensorDicts, written out (the cut checks of :mod:`.minibatch` use them too)
READINGS = _written_out()

#: the written-out checks: the suite's readings, and one check per helper
HELPER_RUNTIME = READINGS + r'''

def check(mini):
    B = CASE["batch_size"]
    every = list(range(B))
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
                built = nested_tensor_from_tensor_list([t.clone() for t in _items(want, key)], ragged_idx=ragged)
            check_nested(built, want, every, f"nested_tensor_from_tensor_list({key!r} items, ragged_idx={ragged})")
            if want.dim() >= 2:
                halves = [_select(mini, rows).get(key) for rows in CASE["halves"]]
                with context():
                    joined = concat_nested_tensors(halves)
                check_nested(joined, want, every, f"concat_nested_tensors({key!r} halves)")
        return None
    if CHECK == "from_samples":
        keys = [k for k in ("input_ids", "position_ids", "responses", "teacher_ids", "routed_experts") if k in mini.keys()]
        per_key = {k: _items(mini.get(k), k) for k in keys}
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
'''
