"""Standalone reproducers for the real-rank invariants (``INV-RANK-*``): the file starts its own gloo ranks.

The file is the engine-case reproducer of the shrunk case (:mod:`.writer`: the micro-batch as data, the engine
built and called as its adapter does, the suite's stand-in model and hand-off, the float64 reference and the
checks of :mod:`.templates`), with its ``main`` run on real ranks instead of threads: started plainly it starts
``sp`` copies of itself (:mod:`.launch`), each joins one gloo group over loopback, builds the engine for its own
``sp_rank`` with an all-gather over that group (``torch.distributed.nn.functional.all_gather``, differentiable),
prepares its inputs, runs the stand-in model once over the joined packed row (every rank's inputs gathered, as the
suite's harness does) and hands the engine its own slice of the output, then saves what it handed the model and
the gathered outputs it returned. The parent checks every rank's outputs against the reference (the single-rank
answer: INV-RANK-001/009 every key, INV-RANK-005 the distillation keys, INV-RANK-007 with a bucket and fused
kernels), the ranks' labels joined against the global row rolled by one (INV-RANK-002), their positions joined
(INV-RANK-004); and what each rank handed its own output step, as its view of the hand-off carries it (the
``pad_size`` it reports, the labels and per-token temperature it hands on, whatever their private shape, the fused
``shift_labels``): INV-RANK-003 the pad size against the bucket and sequence-parallel pad computed in the file,
each rank's token count, the tail's positions and temperature, and the outputs holding exactly the real tokens
(finite where the reference is); INV-RANK-006 the shapes each rank hands over against its share of the padded
row; INV-RANK-008 every position of each rank's labels against its slice of the global row rolled by one, the
zero tail included. INV-RANK-006/008 read the hand-off alone: the ranks stop after ``prepare_model_inputs``.

Not written out: a topology of several SP groups runs here as its first group only, at that group's global ranks
of the topology's world (the other ranks idle).
"""

from __future__ import annotations

import inspect

from ..cases.structure import EngineCase
from ..execute.rank_worker import ShardedTopKProcessor
from ..protocol.vendor import assignments
from ..protocol.vendor import source as source_of
from .vendored import launch, real_ranks

__all__ = ["on_real_ranks"]

def on_real_ranks(source: str, case: EngineCase) -> str:
    """The engine-case reproducer ``source`` of ``case`` (without its main's call) with its ``main`` run on real gloo
    ranks: its topology's first SP group at its global ranks (``[0, sp)`` without one), the other ranks of the world
    idle."""
    head = source.rstrip()
    topology = getattr(case, "topology", None)
    group = list(topology.groups[0]) if topology is not None else list(range(case.sp_size))
    world = topology.world if topology is not None else case.sp_size
    return "\n".join([
        head, "# ---- real ranks (gloo over loopback): this file started once per rank ----",
        assignments({"SP_GROUP": group, "WORLD": world}, {"SP_GROUP": "the SP group's global ranks",
                                                          "WORLD": "the topology's world"}),
        source_of(launch), "",
        "# ---- the stand-in top-K processor on real ranks (spec/execute/rank_worker.py), written out ----",
        inspect.getsource(ShardedTopKProcessor), "", source_of(real_ranks)])
