"""Shared by the reproducer tests: each planted bug's failure written out, and its twin (the same case written for a
correct engine), for the tests to run without the suite."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.protocol.engine import EngineUnderTest
from spec.repro import write_reproducer, write_reproducers
from spec.run.registry import load_engine
from spec.run.runner import run_invariant


def planted_and_twins(folder: Path, bugs, max_examples: int,
                      twin_engine: Callable[[str], object] = lambda invariant: ImplEngine()) -> list[tuple]:
    """``(bug, reproducer, twin path)`` per ``(bug, invariant)``: the planted engine fails ``invariant`` (mode
    ``any``, ``ci``, no shrinking, no database), its reproducer is written, and the twin for ``twin_engine``."""
    made = []
    for bug, invariant in bugs:
        engine = load_engine(f"planted:{bug}")
        outcome = run_invariant(CATALOGUE[invariant], engine, "any", "cpu", profile="ci", shrink=False,
                                max_examples=max_examples, database=None)
        assert outcome.status == "fail", (bug, outcome.status, outcome.error)
        (rep,) = write_reproducers([outcome], engine, folder / bug)
        twin, why = write_reproducer(folder / bug / "twin.py", invariant=invariant, mode="any",
                                     engine=twin_engine(invariant), case=outcome.case)
        assert why is None, why
        made.append((bug, rep, twin))
    return made


class AdapterOnly(ImplEngine):
    """impl through its adapter alone: the protocol's default snippet, which imports this module (and so the suite)
    to build the engine; a file written for it cannot run without the suite."""

    name = "impl-through-its-adapter"
    repro_snippet = EngineUnderTest.repro_snippet
