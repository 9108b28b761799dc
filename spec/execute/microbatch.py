"""The micro-batch layer on real data-parallel ranks: ``prepare_micro_batches`` with a ``torch.distributed``
group, on the gloo (CPU) pool of :mod:`spec.execute.ranks`.

Rank ``r`` of a :class:`spec.cases.microbatch.MiniBatchCase` with ``world`` ranks materialises its own mini-batch
(``case.rank_case(r)``: the ranks' lengths differ, so their own micro-batch counts differ), cuts it once alone
(``dp_group=None``: the count it would choose by itself) and once with the group and ``same_micro_num_in_dp=True``
(what every verl engine calls), and replies with the count, the index lists and each micro-batch's token total.
What a rank runs is :func:`spec.execute.rank_worker.micro_batch_task`.
"""

from __future__ import annotations

from typing import Any

from . import ranks
from .attribution import ENGINE, tag
from ..cases.microbatch import MiniBatchCase

__all__ = ["dp_micro_batch_counts", "MICROBATCH_TASK"]

#: the task kind a rank dispatches to spec.execute.rank_worker.micro_batch_task
MICROBATCH_TASK = "microbatch"


def dp_micro_batch_counts(engine: Any, case: MiniBatchCase, device: str = "cpu") -> list[dict[str, Any]]:
    """Every rank's reply (``count``, ``alone``, ``rows``, ``tokens``), rank 0 first. A rank's exception is
    re-raised here with its original type (the engine's, when its layer raised)."""
    if not 2 <= case.world <= ranks.MAX_WORLD:
        raise ValueError(f"data-parallel runs need 2..{ranks.MAX_WORLD} ranks, the case has {case.world}")
    reason = ranks.unavailable(device, case.world)
    if reason:
        raise ranks.RankFailure(f"real ranks cannot run here: {reason}")
    task = {"engine": engine.name, "recipe": engine.recipe(), "case": case, "device": device, "kind": MICROBATCH_TASK}
    replies = ranks.pool(device).submit(task, case.world)
    errors = sorted((body["error"] for body in replies.values() if "error" in body), key=lambda e: e[0])
    if errors:
        try:
            ranks.raise_rank_error(*errors[0])
        except Exception as exc:  # noqa: BLE001 - raised by the layer on a rank: the engine's
            raise tag(exc, ENGINE)
    return [replies[r] for r in range(case.world)]
