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
from ..invariants.microbatch import NESTED_KEYS, _chunk_count, _halves, _select, _selection, _snapshot, _suite_parts
from ..protocol.vendor import definitions
from ..truth import closeness, microbatch_checks, state_checks
from .plans import layer_checks

__all__ = ["HELPER_CHECKS", "helper_case_data", "readings"]

#: invariant -> (the layer functions it calls, the check in :mod:`.vendored.layer_helper_checks`)
HELPER_CHECKS: dict[str, tuple[tuple[str, ...], str | None]] = layer_checks("helpers")


def helper_case_data(case: MiniBatchCase) -> dict[str, Any]:
    """The seed-drawn structure the helper checks use, as plain values (what the suite's invariants draw)."""
    return {"chunks": _chunk_count(case), "parts": [rows for _, rows in _suite_parts(materialize_minibatch(case), case)],
            "selection": _selection(case), "halves": _halves(case.batch_size), "mrope": case.mrope,
            "nested_keys": list(NESTED_KEYS), "seed": int(case.seed), "outputs": case.outputs}


def readings() -> str:
    """The invariants' own checks and readings (pure torch/tensordict; their ``fail`` is the file's,
    :mod:`.vendored.failure`): spec/truth/closeness.py, microbatch_checks.py and state_checks.py, written out, and the invariants'
    cuts and snapshots of a TensorDict."""
    functions = (_select, _snapshot)
    return "\n\n".join([definitions(closeness), definitions(microbatch_checks), definitions(state_checks),
                         *(inspect.getsource(fn) for fn in functions)])
