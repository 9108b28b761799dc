"""One example's engine runs (spec/execute/memo.py, ``Runs``): a run two checks ask alike is made once, and every
check that reads it sees what the check that made it saw (the run, its engine faults)."""

from __future__ import annotations

import pytest

from spec.cases.structure import EngineCase
from spec.execute import memo
from spec.execute.attribution import EngineFault, note_fault, recording
from spec.execute.memo import Runs
from spec.run.registry import load_engine

CASE = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, use_remove_padding=True)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The engine runs actually made, as (case, poison, stop_after_inputs)."""
    made: list[tuple] = []
    real = memo.execute

    def counting(engine, case, device="cpu", **kwargs):
        made.append((case, kwargs.get("poison", "nan"), kwargs.get("stop_after_inputs", False)))
        return real(engine, case, device, **kwargs)

    monkeypatch.setattr(memo, "execute", counting)
    return made


def test_a_call_made_twice_runs_once_and_a_different_call_runs_again(calls: list[tuple]) -> None:
    engine = load_engine("impl")
    runs = Runs()
    first = runs.execute(engine, CASE)
    assert runs.execute(engine, CASE) is first
    assert runs.execute(engine, EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8,
                                           use_remove_padding=True)) is first  # an equal case is the same call
    other_poison = runs.execute(engine, CASE, poison="huge")
    other_case = runs.execute(engine, CASE.with_(use_remove_padding=False))
    assert len({id(first), id(other_poison), id(other_case)}) == 3
    assert [(c.use_remove_padding, p) for c, p, _ in calls] == [(True, "nan"), (True, "huge"), (False, "nan")]
    assert (runs.made, runs.read) == (3, 2)
    # another example's runs are its own
    assert Runs().execute(engine, CASE) is not first


def test_a_whole_run_answers_a_call_for_the_inputs_alone(calls: list[tuple]) -> None:
    engine = load_engine("impl")
    runs = Runs()
    whole = runs.execute(engine, CASE)
    assert runs.execute(engine, CASE, stop_after_inputs=True) is whole
    assert len(calls) == 1
    # alone, a call for the inputs makes the inputs alone, and a later call for the whole run makes it
    runs = Runs()
    inputs = runs.execute(engine, CASE, stop_after_inputs=True)
    assert not inputs.outputs
    assert runs.execute(engine, CASE).outputs
    assert [s for _, _, s in calls[1:]] == [True, False]


def test_shared_runs_make_the_whole_run_for_the_inputs_and_fall_back_when_it_raises(
        calls: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = load_engine("impl")
    runs = Runs(shared=True)
    inputs = runs.execute(engine, CASE, stop_after_inputs=True)
    assert inputs.outputs and runs.execute(engine, CASE) is inputs
    assert [s for _, _, s in calls] == [False]

    real = memo.execute

    def whole_run_raises(engine, case, device="cpu", **kwargs):
        if not kwargs.get("stop_after_inputs"):
            raise RuntimeError("raised after the inputs")
        return real(engine, case, device, **kwargs)

    monkeypatch.setattr(memo, "execute", whole_run_raises)
    with recording() as log:
        inputs = Runs(shared=True).execute(engine, CASE, stop_after_inputs=True)
    assert inputs.views and not inputs.outputs  # the inputs alone, as asked
    assert log.events == [] and log.faults == []  # nothing the whole run raised reaches the asking check


def test_every_check_reading_a_run_sees_its_engine_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A malformed output is noted while the run is made (in the check that made it); a check that reads the kept
    run gets the same fault noted in its own log, so a crash reading it is blamed on the engine alike."""
    fault = EngineFault("rank 0: output 'log_probs' is malformed")
    made = []

    def malformed(engine, case, device="cpu", **kwargs):
        note_fault(fault)
        made.append(case)
        return object()

    monkeypatch.setattr(memo, "execute", malformed)
    engine = load_engine("impl")
    runs = Runs(shared=True)
    with recording() as first:
        run = runs.execute(engine, CASE)
    with recording() as second:
        assert runs.execute(engine, CASE) is run
    assert first.faults == [fault] and second.faults == [fault] and len(made) == 1


def test_a_run_that_raised_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    def raising(engine, case, device="cpu", **kwargs):
        made.append(case)
        raise ValueError("the engine refused the case")

    monkeypatch.setattr(memo, "execute", raising)
    runs, engine = Runs(), load_engine("impl")
    for _ in range(2):
        with pytest.raises(ValueError, match="refused"):
            runs.execute(engine, CASE)
    assert len(made) == 2 and len(runs) == 0
