"""The checks that a call leaves alone what its caller holds, stated once: the micro-batch, the model's output, the
``output_args`` after ``prepare_model_outputs``; an engine object kept across micro-batches handing over what a fresh
one does and leaving what it returned earlier as returned. And the exact comparison they use (:func:`same`, on copies
:func:`held` takes). The invariants (spec/invariants/batch.py, state.py, microbatch.py) call them on the suite's runs;
a standalone reproducer calls the same functions, vendored beside it (``repro_suite.py``; spec/repro/runtime.py). So
they take plain values (dicts of what was held and what is there now) and fail by :func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

from typing import Any

import torch

from .failing import fail

__all__ = ["batch_entry", "nested_parts", "held", "same", "batch_items", "micro_batch_unchanged", "model_output_unchanged",
           "output_args_unchanged", "handoff_as_fresh", "earlier_kept"]


def nested_parts(value: Any) -> Any:
    """A nested tensor as ``("nested", values, offsets)``; anything else as it is (what a copy of a batch
    keeps, and what :func:`same` compares)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return ("nested", value.values(), value.offsets())
    return value


def held(value: Any) -> Any:
    """A copy of what a caller holds, to compare with :func:`same` later: tensors cloned (a nested one as its
    cloned parts), dicts, lists and tuples item by item, anything else as it is."""
    value = nested_parts(value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: held(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(held(item) for item in value)
    return value


def same(a: Any, b: Any) -> bool:
    """Exactly equal: tensors of one shape and dtype with equal elements (NaN equal to NaN in the same place;
    a nested tensor by its values and offsets), dicts, lists and tuples item by item, anything else by ``==``."""
    a, b = nested_parts(a), nested_parts(b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        return a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a is b:  # one object held twice (an engine's own object in output_args): no method of it is called
        return True
    return a == b


def batch_entry(value: Any) -> Any:
    """One entry of a micro-batch as a caller reads it: a tensor as it is, a per-sample stack (``multi_modal_inputs``:
    a ``NonTensorStack``, whose ``tolist()`` it is) as the list of its samples' values, a flag by its value."""
    if isinstance(value, torch.Tensor):
        return value
    if not hasattr(value, "data") and hasattr(value, "tolist"):  # a stack (a flag's NonTensorData has .data)
        return [getattr(item, "data", item) for item in value.tolist()]
    return getattr(value, "data", value)


def batch_items(td: Any) -> dict[str, Any]:
    """A micro-batch's entries (:func:`batch_entry`): tensors as they are, per-sample stacks as lists, flags by their
    value."""
    return {key: batch_entry(td.get(key)) for key in td.keys()}


def micro_batch_unchanged(before: dict, after: dict) -> None:
    """INV-MUT-001: the micro-batch's entries after the engine ran (``after``: :func:`batch_items`) are those held
    before (``before``)."""
    if set(before) != set(after):
        fail(f"micro-batch keys changed: {sorted(before)} -> {sorted(after)}")
    for key in before:
        if not same(before[key], after[key]):
            fail(f"micro-batch {key!r} was modified in place")


def model_output_unchanged(outputs, snapshots) -> None:
    """INV-MUT-002: every rank's model output fields (``outputs``: per rank, key -> tensor) are those held before
    prepare_model_outputs ran (``snapshots``)."""
    for r, (out, snap) in enumerate(zip(outputs, snapshots)):
        for key, before in snap.items():
            if not same(out[key], before):
                fail(f"rank {r}: model output {key!r} was modified in place by prepare_model_outputs")


def output_args_unchanged(output_args, snapshots) -> None:
    """INV-MUT-004: every rank's output_args after prepare_model_outputs are those held before it ran."""
    for r, (args, snap) in enumerate(zip(output_args, snapshots)):
        if set(args) != set(snap):
            fail(f"rank {r}: output_args keys changed: {sorted(snap)} -> {sorted(args)}")
        for key, before in snap.items():
            if not same(before, args[key]):
                fail(f"rank {r}: output_args[{key!r}] was modified by prepare_model_outputs")


def handoff_as_fresh(reused: dict, fresh: dict, reused_keys, fresh_keys) -> None:
    """INV-BATCH-003: an engine object reused after another micro-batch hands the model what a fresh one does
    (``reused``/``fresh``: name -> what rank 0's view carries) and returns the same output keys."""
    for name, want in fresh.items():
        if not same(reused[name], want):
            fail(f"model hand-off {name!r} after another micro-batch through the same engine object differs from a "
                 "fresh engine's (a cache or a value kept from the earlier call)")
    if set(reused_keys) != set(fresh_keys):
        fail(f"output keys after another micro-batch through the same engine object {sorted(reused_keys)}, a fresh "
             f"engine's {sorted(fresh_keys)}")


def earlier_kept(outputs: dict, kept_outputs: dict, inputs: dict, kept_inputs: dict) -> None:
    """INV-MUT-005: what an earlier call returned (``outputs``) and handed the model (``inputs``), read after the same
    engine object prepared the next micro-batch, is what was held when it returned (``kept_*``: :func:`held`)."""
    for key in sorted(set(outputs) | set(kept_outputs)):
        if key not in outputs or key not in kept_outputs or not same(outputs[key], kept_outputs[key]):
            fail(f"output {key!r} of the earlier micro-batch changed when the same engine object prepared the next "
                 "one (an output buffer reused across calls)")
    for name, before in kept_inputs.items():
        if not same(inputs[name], before):
            fail(f"model hand-off {name!r} of the earlier micro-batch changed when the same engine object prepared "
                 "the next one (an input buffer reused across calls)")
