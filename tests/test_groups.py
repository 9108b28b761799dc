"""Shared runs (spec/run/groups.py, ``run_group``): the targets that draw the same cases share each drawn case and
its engine run, and each still reports what it would report alone: its examples, its outcome, its shrunk
counterexample."""

from __future__ import annotations

import pytest

import spec.invariants.core as core
import spec.invariants.state as state
from spec.execute import harness, memo
from spec.invariants import CATALOGUE
from spec.planted import planted_engine
from spec.run.groups import groups
from spec.run.registry import load_engine
from spec.run.runner import instances, run_group, run_invariant, stream_key, stream_seed

#: the padded stream's plain checks: every one reads the plain run (their adjustments agree on most cases)
PADDED = [(CATALOGUE[i], "padded") for i in ("INV-KEYS-001", "INV-LABEL-001", "INV-MASK-001", "INV-DEV-001",
                                              "INV-POS-001", "INV-LAYOUT-001")]


def test_the_catalogue_shares_streams_and_keeps_subclasses_alone() -> None:
    """Most targets share a stream with others; a micro-batch or drop-in invariant (its own kind of case) is alone,
    keyed by its ID."""
    pairs = instances()
    tasks = groups(pairs)
    assert sorted(n for task in tasks for n in task) == list(range(len(pairs)))  # a partition
    shared = [task for task in tasks if len(task) > 1]
    assert sum(map(len, shared)) > len(pairs) / 2, "fewer than half of the targets share a stream"
    for task in tasks:
        assert len({stream_key(*pairs[n]) for n in task}) == 1
    mb = CATALOGUE["INV-MB-001"]
    assert mb.stream("any") is None and stream_key(mb, "any") == b"INV-MB-001/any"
    assert stream_key(*PADDED[0]) == stream_key(*PADDED[1]) == b"batch/lm//padded"


def test_the_seed_is_the_keys_digest_alone() -> None:
    """The seed comes from the stream key, not from the runner's source: the same key, the same seed; another key
    or an explicit seed, another."""
    key = stream_key(*PADDED[0])
    assert stream_seed(key) == stream_seed(bytes(key))
    assert stream_seed(key) != stream_seed(b"batch/lm//packed")
    assert stream_seed(key, 1) != stream_seed(key) != stream_seed(key, 2)


def test_a_group_reports_what_each_target_reports_alone() -> None:
    """Each member of a group sees exactly the cases it draws alone (its stream's seed): the same status, examples,
    distinct cases and drawn dimensions."""
    engine = load_engine("impl")
    together = run_group(PADDED, engine, "cpu", profile="ci", max_examples=8)
    for (info, mode), shared in zip(PADDED, together):
        alone = run_invariant(info, engine, mode, "cpu", profile="ci", max_examples=8)
        assert (shared.invariant, shared.mode) == (info.id, mode)
        assert shared.status == alone.status == "pass", (shared.error, alone.error)
        assert shared.examples == alone.examples >= 8
        assert shared.distinct_cases == alone.distinct_cases
        assert shared.coverage == alone.coverage


def test_one_engine_run_feeds_every_check_of_a_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group runs the engine once per distinct shaped case, not once per check: fewer runs than the members
    alone, at least one per example."""
    engine = load_engine("impl")
    calls = []
    real = harness.execute

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(harness, "execute", counting)
    monkeypatch.setattr(core, "execute", counting)  # the name a check's own reruns call
    monkeypatch.setattr(memo, "execute", counting)  # the name the example's runs call
    outcomes = run_group(PADDED, engine, "cpu", profile="ci", max_examples=6)
    together = len(calls)
    calls.clear()
    for info, mode in PADDED:
        run_invariant(info, engine, mode, "cpu", profile="ci", max_examples=6)
    alone = len(calls)
    examples = max(o.examples for o in outcomes)
    assert examples <= together < alone / 2, (together, alone)


def test_a_failing_member_shrinks_alone_and_the_others_go_on() -> None:
    """A planted bug that one member of the padded stream rejects: that member fails with its own shrunk
    counterexample (run again alone), the other members pass with their full count of examples."""
    engine = planted_engine("loss_mask_attention")  # the seed report's bug: INV-MASK-001 rejects it
    outcomes = {o.invariant: o for o in run_group(PADDED, engine, "cpu", profile="ci", max_examples=20)}
    failed = outcomes.pop("INV-MASK-001")
    assert failed.rejected_by_check and failed.counterexample and failed.case is not None, failed
    assert "padded" in failed.counterexample
    for other in outcomes.values():
        assert other.status in ("pass", "fail"), other
        if other.status == "pass":
            assert other.examples >= 20
    assert any(o.status == "pass" for o in outcomes.values())


@pytest.mark.parametrize("short", [False, True])
def test_a_stopped_group_reruns_alone_only_the_members_short_of_their_examples(
        short: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's stream that stopped early (a fault budget spent, a health check) leaves its members short of their
    examples: those run again alone. A member that ran all its examples before the stop keeps its outcome."""
    from spec.run import runner

    real_run, alone = runner.StreamRun.run, []

    def stopped(self, strategy, pinned, key, parent, **kwargs):
        if short:  # the stream stops after 2 of its examples
            kwargs["overrides"] = {**kwargs["overrides"], "max_examples": 2}
        real_run(self, strategy, pinned, key, parent, **kwargs)
        self.bounds["stopped"] = "stopped here (the test's)"

    real_alone = runner.run_invariant

    def counting(info, *args, **kwargs):
        alone.append(info.id)
        return real_alone(info, *args, **kwargs)

    monkeypatch.setattr(runner.StreamRun, "run", stopped)
    monkeypatch.setattr(runner, "run_invariant", counting)
    outcomes = run_group(PADDED[:3], load_engine("impl"), "cpu", profile="ci", max_examples=6)
    assert alone == ([info.id for info, _ in PADDED[:3]] if short else [])
    assert all(o.status == "pass" and o.examples >= 6 for o in outcomes), outcomes


#: two checks of one engine object kept across micro-batches: both read one sibling-then-case sequence per example
REUSED = [(CATALOGUE["INV-BATCH-003"], "padded"), (CATALOGUE["INV-MUT-005"], "padded")]


@pytest.mark.parametrize("bug, rejecting", [(None, None), ("mask_cached_by_shape", "INV-BATCH-003"),
                                            ("log_probs_in_reused_buffer", "INV-MUT-005")])
def test_a_sequence_two_checks_make_alike_is_made_once_and_each_still_rejects_its_bug(
        bug: str | None, rejecting: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """INV-BATCH-003 and INV-MUT-005 read one sibling-then-case sequence through one engine object (``Runs.sequence``):
    in their group it is made once per example, not once per check, and each check still rejects the planted bug of
    its own property while the other passes."""
    made, real = [], state._sibling_then_case

    def counting(ctx):
        made.append(repr(ctx.case))
        return real(ctx)

    monkeypatch.setattr(state, "_sibling_then_case", counting)
    engine = load_engine("impl") if bug is None else planted_engine(bug)
    outcomes = {o.invariant: o for o in run_group(REUSED, engine, "cpu", profile="ci", max_examples=12)}
    if bug is None:
        assert all(o.status == "pass" and o.examples >= 12 for o in outcomes.values()), outcomes
        examples = outcomes["INV-BATCH-003"].examples
        assert len(made) == examples, (len(made), examples)  # once per example (not twice), both checks read it
    else:
        assert outcomes.pop(rejecting).rejected_by_check
        assert [o.status for o in outcomes.values()] == ["pass"], outcomes
