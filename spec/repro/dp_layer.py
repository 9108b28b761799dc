"""The standalone reproducer of INV-MB-005 (``prepare_micro_batches`` on data-parallel ranks): the file starts its
own gloo ranks.

Every rank's mini-batch (``case.rank_case(r)``) is saved in the ``.pt`` beside the file. Run plainly, the file
starts ``world`` copies of itself as subprocesses (``--rank r``), which join one gloo group over loopback
(``torch.distributed``, a free TCP port), load their own mini-batch, cut it alone (``dp_group=None``: the count the
rank would choose by itself) and with the group and ``same_micro_num_in_dp=True`` (what every verl engine calls),
in the case's autograd context, and write their count, index lists and token totals as JSON. The parent checks
what the invariant states: one count on every rank, each rank's micro-batches a partition of its samples within
its budget, or a refusal on every rank where no one count fits every rank's groups (from the case's structure).

Without an accelerator a layer whose module asks ``get_device_name()`` for the device of its collective's tensors
(verl's ``seqlen_balancing``, which answers "cuda" on a CPU machine) gets "cpu" there, the device of the gloo
group, as the suite's adapter does (:func:`spec.engines.verl.microbatch_layer._cpu_collectives`); nothing else is changed.
"""

from __future__ import annotations

import inspect
import pprint
from pathlib import Path
from typing import Any, Callable

import torch

from ..cases.microbatch import MiniBatchCase, materialize_minibatch
from ..execute.pickling import save
from ..invariants.microbatch import dp_count_feasible, dp_lower_count
from ..protocol.vendor import definitions, source
from ..truth import closeness, microbatch_checks, state_checks
from .minibatch import case_dict, layer_imports, plain_minibatch
from .plans import layer_checks
from .vendored import dp_ranks, failure, launch, layer_call

__all__ = ["DP_CHECKS", "write_dp_reproducer"]

#: invariant -> the layer functions it calls
DP_CHECKS: dict[str, tuple[str, ...]] = {inv: functions for inv, (functions, _) in layer_checks("ranks").items()}


def _device_modules(functions: dict[str, Callable[..., Any]]) -> list[str]:
    """The modules of the layer's cutting functions (unwrapped) that name a ``get_device_name``."""
    modules = []
    for name in ("prepare_micro_batches", "rearrange_micro_batches"):
        fn = functions.get(name)
        module = inspect.getmodule(inspect.unwrap(fn)) if fn is not None else None
        if module is not None and callable(getattr(module, "get_device_name", None)) and \
                module.__name__ not in modules:
            modules.append(module.__name__)
    return modules


def write_dp_reproducer(path: Path, header: str, invariant: str, functions: dict[str, Callable[..., Any]],
                        case: MiniBatchCase, factory: Any = None) -> str | None:
    """Write ``path`` (and its ``.pt`` of every rank's mini-batch); returns why it is not standalone, or None."""
    imports, why = layer_imports(functions, DP_CHECKS[invariant], factory)
    if why:
        return why
    if case.world < 2:
        return f"{invariant} needs two or more data-parallel ranks; the case has {case.world}"
    ranks = [case.rank_case(r) for r in range(case.world)]
    save([plain_minibatch(materialize_minibatch(rc, "cpu")) for rc in ranks], path.with_suffix(".pt"))
    data = {**case_dict(case), "world": case.world,
            "ranks": [{"batch_size": rc.batch_size, "budget": rc.budget, "num_groups": rc.num_groups} for rc in ranks],
            # from the structure: whether one count fits every rank (True), none can (False), the bounds cannot tell
            "feasible": dp_count_feasible(case), "lower_count": dp_lower_count(case)}
    path.write_text("\n".join([
        header, "from pathlib import Path", "from typing import Any", "", "import torch", "",
        "# ---- the engine's layer ----", imports, "", f"INVARIANT = {invariant!r}",
        "CASE = " + pprint.pformat(data, width=120, sort_dicts=False),
        f"DEVICE_MODULES = {_device_modules(functions)!r}", "MINIS = Path(__file__).with_suffix('.pt')", "",
        source(failure), "# ---- the invariant's checks (spec/truth/closeness.py, microbatch_checks.py, state_checks.py), "
        "written out ----", definitions(closeness), definitions(microbatch_checks), definitions(state_checks), source(launch), source(layer_call), source(dp_ranks)]))
    return None
