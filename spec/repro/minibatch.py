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
from .imports import factory_layer_imports, function_imports
from .layer_helpers import HELPER_CHECKS, HELPER_RUNTIME, READINGS, helper_case_data

__all__ = ["MB_CHECKS", "write_minibatch_reproducer", "layer_imports", "case_dict", "plain_minibatch", "COMMON", "MAIN"]

#: invariant -> (the layer functions it calls, the check in :data:`_RUNTIME`)
MB_CHECKS: dict[str, tuple[tuple[str, ...], str]] = {
    "INV-MB-001": (("prepare_micro_batches",), "partition"),
    "INV-MB-002": (("prepare_micro_batches",), "groups"),
    "INV-MB-003": (("prepare_micro_batches",), "budget"),
    "INV-MB-004": (("prepare_micro_batches",), "count"),
    "INV-MB-006": (("prepare_micro_batches",), "fixed"),
    "INV-MB-007": (("prepare_micro_batches", "restore_dynamic_batch"), "restore"),
}


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
            "feasible": case.count_feasible()}


def write_minibatch_reproducer(path: Path, header: str, invariant: str, functions: dict[str, Callable[..., Any]],
                               case: MiniBatchCase, factory: Any = None) -> str | None:
    """Write ``path`` (and its ``.pt``); returns why it is not standalone, or None."""
    if invariant in MB_CHECKS:
        (names, check), extra, checks = MB_CHECKS[invariant], {}, READINGS + _CUT_CHECKS
    elif invariant in HELPER_CHECKS:
        (names, check), extra, checks = HELPER_CHECKS[invariant], helper_case_data(case), HELPER_RUNTIME
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
        f"MINI = Path(__file__).with_suffix('.pt')", "", "", inspect.getsource(micro_batch_rows), COMMON, checks, MAIN]))
    return None


#: what every micro-batch reproducer runs with: the case's autograd context, the layer's cut, a sample list
COMMON = r'''

class Wrong(Exception):
    """What the layer got wrong on this case: got vs expected."""


def context():
    return {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[CASE["context"]]()


def cut(mini):
    with context():
        micro, indices = prepare_micro_batches(
            mini, num_batches_divided_by=CASE["num_batches_divided_by"], min_num_micro_batch=CASE["min_num_micro_batch"],
            use_dynamic_bsz_balance=CASE["balance"])
    return list(micro), indices


def samples(value):
    return [t for t in value.unbind()] if value.is_nested else list(value)
'''

#: the checks on what prepare_micro_batches / restore_dynamic_batch return (INV-MB-001/002/003/004/006/007)
_CUT_CHECKS = r'''

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


'''

#: loads the mini-batch, runs ``check``, exits 1 with what was wrong, 0 when right
MAIN = r'''

def main():
    mini = torch.load(MINI, weights_only=False)
    try:
        problem = check(mini)
    except Wrong as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - the layer raised on a case it must take: wrong, as the header says
        problem = f"raised {type(exc).__name__}: {exc}; expected a result on this case"
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    print(f"PASS: {INVARIANT} holds on this mini-batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''
