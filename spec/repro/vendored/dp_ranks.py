"""The data-parallel micro-batch reproducer's main (INV-MB-005; :mod:`spec.repro.dp_layer`): started plainly, the file
starts one copy of itself per data-parallel rank (:mod:`.launch`), each cutting its own saved mini-batch alone and
with the gloo group (``same_micro_num_in_dp=True``); the parent checks one count on every rank, each rank's
micro-batches a partition of its samples within its budget, or a refusal on every rank where no one count fits.
Vendored after the file's constants and the engine's layer functions, with the launcher before it."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

#: what the file binds for this module: the case, the invariant, the saved mini-batches, the modules whose
#: get_device_name answers "cpu" without an accelerator, the layer's cut (:mod:`.layer_call`), the
#: verdict (:mod:`.failure`), the launcher's functions and the invariant's check (spec/truth/microbatch_checks.py)
BOUND = ("CASE", "MINIS", "DEVICE_MODULES", "cut", "verdict", "run_ranks", "join_group", "dp_same_count")


def cpu_collectives():
    """Without an accelerator, the layer's collective tensors on the gloo group's device (cpu)."""
    if torch.cuda.is_available():
        return
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
    dp_same_count(replies, feasible, CASE["lower_count"], CASE["ranks"])  # INV-MB-005's own check
    return None


def main():
    try:
        problem = check()
    except AssertionError as exc:  # the invariant's check failed (the file's fail: :mod:`.failure`)
        problem = str(exc)
    return verdict(problem, "these ranks' mini-batches")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    sys.exit(main())
