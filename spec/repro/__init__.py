"""Standalone reproducers: for each failed outcome of ``python -m spec verify``, a Python file that rebuilds the
shrunk case's micro-batch with plain torch and tensordict, calls the engine as its adapter does, runs the
stand-in model written out, and compares with a float64 reference written out too: exit 1 with got vs
expected at the first wrong position, 0 when right (:mod:`.writer`). Which checks each invariant's reproducer
runs, on which runs of the case: :mod:`.plans`; the micro-batch as data: :mod:`.micro_batch`; the code blocks:
:mod:`.templates`; the runtime every engine-case file loads from its folder (a copy of :mod:`.runtime`). A face of the suite (it may import every layer below).
"""

from .plans import Plan, plan_for, rank_plan_for
from .writer import Reproducer, run_reproducer, safe_name, write_reproducer, write_reproducers

__all__ = ["Plan", "plan_for", "rank_plan_for", "Reproducer", "run_reproducer", "safe_name", "write_reproducer",
           "write_reproducers"]
