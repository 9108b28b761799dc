"""One example's engine runs, kept for every check of it: a run two checks ask alike is made once.

In a shared stream (spec/run/groups.py) every member checks its own shape of one drawn case, and many checks rerun
the engine on a variant of it: the case with ``sp_size=1``, without its bucket, in the other mode, on real ranks.
Such a variant is often another member's own case, or another check's same rerun. :class:`Runs` keeps the runs of one
example by what was run, so each is made once and read by every check that asks it.

Only plain calls are kept: the case as :func:`~spec.execute.harness.execute` materializes it, the device, the poison
in the padding, whether the run stopped after the model inputs, and whether it ran on real ranks. A call with a
micro-batch or engine objects of the caller's own is that check's alone and always runs, unless the check names the
whole sequence of calls it makes (:meth:`Runs.sequence`: a sibling micro-batch then the case through one engine
object, which two checks read for different properties). A run that raised is not
kept (the next check asking it runs it again and sees the same exception). A run's engine faults (malformed outputs
the suite noted while making it: :func:`~spec.execute.attribution.note_fault`) are noted again for every check that
reads it, so a check that fails on them is blamed on the engine alike, whichever check made the run.

The oracle's expectation is kept alike (:meth:`Runs.oracle`): one per oracle key of the example's cases, the
checks' shapes of one drawn case mostly differing in layout fields the oracle never reads.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ..cases.structure import EngineCase
from ..protocol.engine import EngineUnderTest
from ..truth.oracle import oracle_key
from . import ranks
from .attribution import faults_noted, note_fault, trial
from .handoff import Run
from .harness import execute, sp_runner_of

__all__ = ["Runs"]

T = TypeVar("T")


class Runs:
    """The engine runs of one example, by call (see the module's docstring).

    ``shared``: the runs are read by several checks (a stream's members). A call for the model inputs alone then
    makes the whole run, which answers a later check's call for the whole run too (another member's own case, on real
    ranks as often as not); if the whole run raises, the inputs are made alone, as asked, and nothing the whole run
    raised or noted reaches the asking check (:func:`~spec.execute.attribution.trial`)."""

    def __init__(self, shared: bool = False) -> None:
        self.shared = shared
        self._runs: dict[tuple, tuple[Any, tuple]] = {}
        self._oracles: dict[tuple, Any] = {}
        self.made = self.read = 0  # runs made, and runs read again from here (for the benchmarks)

    def execute(self, engine: EngineUnderTest, case: EngineCase, device: str = "cpu", *, poison: str = "nan",
                stop_after_inputs: bool = False) -> Run:
        """:func:`~spec.execute.harness.execute` of ``case``, made once per example (on real ranks where the engine's
        sequence parallelism runs there: the same run as :meth:`on_ranks`)."""
        where = "ranks" if case.sp_size > 1 and sp_runner_of(engine) is ranks.execute else "engine"
        return self._get((where, engine.name, repr(case), device, poison), stop_after_inputs,
                         lambda inputs_only: execute(engine, case, device, poison=poison,
                                                     stop_after_inputs=inputs_only))

    def on_ranks(self, engine: EngineUnderTest, case: EngineCase, device: str = "cpu", *,
                 stop_after_inputs: bool = False) -> Run:
        """:func:`spec.execute.ranks.execute` of ``case`` (on ``case.sp_size`` real ranks), made once per example."""
        return self._get(("ranks", engine.name, repr(case), device, "nan"), stop_after_inputs,
                         lambda inputs_only: ranks.execute(engine, case, device, stop_after_inputs=inputs_only))

    def sequence(self, what: str, engine: EngineUnderTest, case: EngineCase, device: str, make: Callable[[], T]) -> T:
        """A check's own sequence of engine calls that another check of the example makes alike (``what`` names it:
        e.g. a sibling micro-batch, then the case, through one engine object), made once per example by ``make``
        and read by every check that asks it, its engine faults noted again for each as a run's are."""
        return self._get((what, engine.name, repr(case), device, ""), False, lambda _inputs_only: make())

    def oracle(self, case: EngineCase, engine: EngineUnderTest, make: Callable[[], T]) -> T:
        """The oracle's expectation for ``case`` (``make``), made once per example for every case with its oracle key
        (:func:`~spec.truth.oracle.oracle_key`: the checks' shapes of one drawn case mostly differ in fields the
        oracle never reads) and the engine's head input (the model it is computed from)."""
        key = (oracle_key(case), getattr(engine, "head_input", None))
        if key not in self._oracles:
            self._oracles[key] = make()
        return self._oracles[key]

    def _get(self, call: tuple, inputs_only: bool, make: Callable[[bool], Any]) -> Any:
        # a whole run also answers a call for the model inputs alone (they are the same first step)
        for key in ((*call, False), (*call, True)) if inputs_only else ((*call, False),):
            kept = self._runs.get(key)
            if kept is not None:
                run, faults = kept
                for fault in faults:
                    note_fault(fault)
                self.read += 1
                return run
        if inputs_only and self.shared:
            try:
                with trial():
                    return self._make(call, False, make)
            except Exception:  # noqa: BLE001 - the whole run failed: the inputs alone, as asked
                pass
        return self._make(call, inputs_only, make)

    def _make(self, call: tuple, inputs_only: bool, make: Callable[[bool], Any]) -> Any:
        with faults_noted() as faults:
            run = make(inputs_only)
        self._runs[(*call, inputs_only)] = (run, tuple(faults))
        self.made += 1
        return run

    def __len__(self) -> int:
        return len(self._runs)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Runs({len(self._runs)} kept, {self.made} made, {self.read} read again)"
