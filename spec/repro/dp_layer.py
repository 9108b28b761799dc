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
from .launch import LAUNCH
from .minibatch import case_dict, layer_imports, plain_minibatch

__all__ = ["DP_CHECKS", "write_dp_reproducer"]

#: invariant -> the layer functions it calls
DP_CHECKS: dict[str, tuple[str, ...]] = {"INV-MB-005": ("prepare_micro_batches",)}


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
        header, "import json", "import os", "import socket", "import subprocess", "import sys", "import tempfile",
        "from pathlib import Path", "", "import torch", "import torch.distributed as dist", "",
        "# ---- the engine's layer ----", imports, "", f"INVARIANT = {invariant!r}",
        "CASE = " + pprint.pformat(data, width=120, sort_dicts=False),
        f"DEVICE_MODULES = {_device_modules(functions)!r}", "MINIS = Path(__file__).with_suffix('.pt')", LAUNCH, _RUNTIME]))
    return None


_RUNTIME = r'''

def context():
    return {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[CASE["context"]]()


def cut(mini, **group):
    with context():
        micro, indices = prepare_micro_batches(
            mini, num_batches_divided_by=CASE["num_batches_divided_by"], min_num_micro_batch=CASE["min_num_micro_batch"],
            use_dynamic_bsz_balance=CASE["balance"], **group)
    return list(micro), indices


def cpu_collectives():
    """Without an accelerator, the layer's collective tensors on the gloo group's device (cpu)."""
    if torch.cuda.is_available():
        return
    import importlib
    for name in DEVICE_MODULES:
        importlib.import_module(name).get_device_name = lambda: "cpu"


def rank_main(rank, port, out):
    cpu_collectives()
    join_group(rank, CASE["world"], port)
    mini = torch.load(MINIS, weights_only=False)[rank]
    reply = {"rank": rank}
    try:
        status = ["ok", len(cut(mini)[0])]
    except Exception as exc:  # noqa: BLE001 - told to the other ranks before the collective call
        status = ["error", f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)]
    everyone = [None] * CASE["world"]
    dist.all_gather_object(everyone, status)  # an error on one rank must not leave the others in the collective
    failed = [(r, s) for r, s in enumerate(everyone) if s[0] == "error"]
    if failed:
        reply["error"] = [failed[0][0], *failed[0][1][1:]]
    else:
        try:
            micro, indices = cut(mini, dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
            reply.update(alone=status[1], count=len(micro),
                         rows=[[int(i) for i in part] for part in indices] if indices is not None else None,
                         tokens=[int(mb.get("input_ids").offsets()[-1]) for mb in micro])
        except Exception as exc:  # noqa: BLE001
            reply["error"] = [rank, f"{type(exc).__name__}: {exc}", isinstance(exc, ValueError)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(reply))
    dist.destroy_process_group()


def check():
    feasible = CASE["feasible"]
    if feasible is None:
        print("NOT EXERCISED: whether one count fits every rank's groups cannot be told from the bounds")
        return None
    replies, problem = run_ranks(CASE["world"], "rank{rank}.json", lambda path: json.loads(path.read_text()))
    if problem:
        return problem
    errors = [r["error"] for r in replies if "error" in r]
    if errors:
        rank, text, value_error = errors[0]
        if feasible is False and value_error:
            return None  # the count every rank needs exceeds a rank's groups: refused on every rank
        return f"rank {rank} raised {text}, expected micro-batches on every rank"
    if feasible is False:
        fewest = min(r["num_groups"] for r in CASE["ranks"])
        return (f"every rank accepted, expected a refusal: the ranks need {CASE['lower_count']} or more micro-batches "
                f"but a rank has only {fewest} groups")
    counts = [r["count"] for r in replies]
    if len(set(counts)) > 1:
        return (f"ranks got {counts} micro-batches (alone {[r['alone'] for r in replies]}), expected one count on every "
                "rank (same_micro_num_in_dp)")
    for rank, (reply, mine) in enumerate(zip(replies, CASE["ranks"])):
        rows = reply["rows"] or []
        if sorted(i for part in rows for i in part) != list(range(mine["batch_size"])):
            return f"rank {rank}: got index lists {str(rows)[:120]}, expected each of its {mine['batch_size']} samples once"
        over = [t for t in reply["tokens"] if t > mine["budget"]]
        if over:
            return f"rank {rank}: micro-batches of {over} tokens, expected at most the budget {mine['budget']}"
    return None


def main():
    problem = check()
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    print(f"PASS: {INVARIANT} holds on these ranks' mini-batches")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    sys.exit(main())
'''
