"""Standalone reproducers for the micro-batch layer's invariants (``INV-MB-*``: a :class:`MiniBatchCase`).

The file loads the shrunk case's mini-batch (a ``TensorDict`` saved beside it as ``.pt``: torch + tensordict
read it), imports the engine's own layer functions by their module and name (the layer a trainer calls: verl's
``verl.utils.seqlen_balancing`` / ``verl.workers.utils``, impl's ``impl.microbatch``), calls them as the suite
does, in the case's autograd context, and checks what the invariant checks: which samples each micro-batch
holds, their tokens, the token budget, forced groups, the fixed path's chunks, the restored order, the keys. The
expected side comes from the case's structure (its lengths, budget and settings), never from the layer. It exits 1
printing got vs expected, 0 when the layer is right, 2 where no standalone check exists (a layer function
defined by the suite itself, e.g. a planted bug's wrapper, or an invariant without a check here).
"""

from __future__ import annotations

import inspect
from enum import Enum
import pprint
from pathlib import Path
from typing import Any, Callable

import torch

from ..cases.microbatch import MiniBatchCase, materialize_minibatch, micro_batch_rows
from ..execute.pickling import save
from ..protocol.vendor import source
from .imports import factory_layer_imports, function_imports
from .layer_helpers import HELPER_CHECKS, helper_case_data, readings
from .plans import layer_checks
from .vendored import failure, layer_call, layer_cut_checks, layer_helper_checks, layer_main

__all__ = ["MB_CHECKS", "write_minibatch_reproducer", "layer_imports", "case_dict", "plain_minibatch"]

#: invariant -> (the layer functions it calls, the check in :mod:`.vendored.layer_cut_checks`): each invariant's own
#: record (``LayerCheck(on="cut")``)
MB_CHECKS: dict[str, tuple[tuple[str, ...], str | None]] = layer_checks("cut")


def layer_imports(functions: dict[str, Callable[..., Any]], names: tuple[str, ...], factory: Any = None
                  ) -> tuple[str | None, str | None]:
    """Code binding each of ``names`` to the layer's own function (:func:`.imports.function_imports`), or
    ``(None, why)`` when one is not importable by its module and name (a closure, a lambda); ``factory``: the
    ``(layer -> layer, base layer)`` that made the layer (a planted bug over impl's), written out instead."""
    imports, why = function_imports({name: functions.get(name) for name in names})
    if why and factory is not None:
        imports, also = factory_layer_imports(*factory, names)
        why = None if imports else f"{why}; {also}"
    return imports, why


def plain_minibatch(mini: Any) -> Any:
    """The mini-batch with the suite's own ``str`` enums (its stand-in for verl's ``DatasetPadMode``) as plain
    strings, equal to them: the saved file unpickles with torch and tensordict alone."""
    for key in list(mini.keys()):
        value = mini.get_non_tensor(key) if hasattr(mini, "get_non_tensor") else None
        if isinstance(value, Enum) and isinstance(value, str):
            mini.set_non_tensor(key, str(value.value))
    return mini


def case_dict(case: MiniBatchCase) -> dict[str, Any]:
    return {"batch_size": case.batch_size, "seq_lens": list(case.seq_lens), "budget": case.budget,
            "max_token_len": case.max_token_len, "sp_size": case.sp_size,
            "use_dynamic_bsz": case.use_dynamic_bsz, "balance": case.balance,
            "num_batches_divided_by": case.num_batches_divided_by, "min_num_micro_batch": case.min_num_micro_batch,
            "force_group_size": case.force_group_size, "micro_batch_size": case.micro_batch_size,
            "over_budget": case.over_budget, "fixed_divides": case.fixed_divides,
            "refusable": (case.over_budget or case.count_feasible() is not True) if case.use_dynamic_bsz
            else not case.fixed_divides, "context": case.context,
            # the count rules' expectations (INV-MB-004), from the structure: the fewest count when everything
            # fits one budget, and whether some count within the groups meets the rules and the budget
            "num_groups": case.num_groups, "total_nnz": case.total_nnz, "required_count": case.required_count(),
            "feasible": case.count_feasible(), "longest_group": max(case.group_tokens)}


def write_minibatch_reproducer(path: Path, header: str, invariant: str, functions: dict[str, Callable[..., Any]],
                               case: MiniBatchCase, factory: Any = None) -> str | None:
    """Write ``path`` (and its ``.pt``); returns why it is not standalone, or None."""
    if invariant in MB_CHECKS:
        (names, check), extra, checks = MB_CHECKS[invariant], {}, layer_cut_checks
    elif invariant in HELPER_CHECKS:
        (names, check), extra, checks = HELPER_CHECKS[invariant], helper_case_data(case), layer_helper_checks
    else:
        return (f"{invariant} has no standalone micro-batch check in spec/repro/minibatch.py (standalone: "
                f"{', '.join([*MB_CHECKS, *HELPER_CHECKS])}; INV-MB-015: spec/repro/end_to_end.py)")
    imports, why = layer_imports(functions, names, factory)
    if why:
        return why
    pt = path.with_suffix(".pt")
    save(plain_minibatch(materialize_minibatch(case, "cpu")), pt)
    path.write_text("\n".join([
        header, "import pickle", "import sys", "from pathlib import Path", "from typing import Any", "", "import torch",
        "from tensordict import TensorDict", "", "# ---- the engine's layer ----", imports, "",
        f"INVARIANT = {invariant!r}", f"CHECK = {check!r}",
        "CASE = " + pprint.pformat({**case_dict(case), **extra}, width=120, sort_dicts=False),
        f"MINI = Path(__file__).with_suffix('.pt')", "", "", inspect.getsource(micro_batch_rows), source(failure), source(layer_call),
        "# ---- the invariants' checks and readings (spec/truth/closeness.py, microbatch_checks.py, "
        "spec/invariants/microbatch.py, core.py), written out ----",
        readings(), source(checks), source(layer_main)]))
    return None
