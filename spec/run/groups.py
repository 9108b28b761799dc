"""Targets that share a case stream: one draw per example, one engine run per shaped case, every check of them.

Most checks read nothing but the plain run of a case: its model inputs, its outputs and their oracle (the value, key,
layout, leak, device, slice and label checks). Each used to draw its own cases and run the engine on each. As
PyTorch's OpInfo does (one sample input, many checks), the targets whose invariants draw the same strategy before
their own adjustment (:meth:`~spec.invariants.InvariantInfo.stream`) form a group: :func:`spec.run.runner.run_group`
draws each case once, shapes it for every member, runs the engine once per distinct shaped case and hands every
member's check the same run and oracle (a check that reruns keeps its own reruns). Each member still reports its
own examples, outcome and known failures; a member that fails is run again alone, where its failure shrinks.

A target alone draws the same cases as in its group (its seed is the stream's key), so ``run_invariant`` on one
target (the pytest plugin, tests/test_power.py) sees what ``spec verify`` sees.
"""

from __future__ import annotations

from ..invariants import InvariantInfo

__all__ = ["groups"]


def groups(pairs: list[tuple[InvariantInfo, str]]) -> list[list[int]]:
    """Indices of ``pairs`` grouped by stream key (each group in ``pairs``' order, the groups in the order of their
    first member); a target without a shared stream (:meth:`~spec.invariants.InvariantInfo.stream` is None) alone."""
    out: list[list[int]] = []
    by_key: dict[str, list[int]] = {}
    for n, (info, mode) in enumerate(pairs):
        key = info.stream(mode)
        if key is None:
            out.append([n])
        elif key in by_key:
            by_key[key].append(n)
        else:
            by_key[key] = [n]
            out.append(by_key[key])
    return out
