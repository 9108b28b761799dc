"""Runs catalogue entries against an engine with hypothesis; one code path for pytest and the CLI."""

from __future__ import annotations

import os
import time
import zlib
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import Phase, example, given, seed as hypothesis_seed, settings
from hypothesis.errors import HypothesisException

from ..execute import ranks
from ..execute.attribution import ENGINE, AttributedEngine, EngineFault, SuiteError, describe, origin
from ..execute.attribution import recording as record_attribution

from ..cases.coverage import dimensions
from ..cases.structure import DenseCase, EngineCase
from ..protocol.engine import EngineUnderTest
from ..cases.strategies import within_limits
from ..invariants import CATALOGUE, Ctx as CheckContext, InvariantInfo
from ..invariants.core import convention_skip, honour_engine, mode_reason
from ..protocol.known import KnownFailure, applicable, as_records, matching as match_record

__all__ = ["Outcome", "instances", "skip_reason", "run_invariant", "runs_on_ranks", "SEED_CASES", "DEVICES",
           "fault_budget", "shrink_deadline"]

DEVICES = ("cpu", "cuda")


def fault_budget() -> int:
    """Examples per target that may end in a rank fault (a rank that died, hung or disconnected: each replaces the
    rank pool) before the run stops with the smallest such example so far (``SPEC_FAULT_BUDGET``, default 3): the
    bound on pool restarts per target."""
    return int(os.environ.get("SPEC_FAULT_BUDGET", "3"))


def shrink_deadline() -> float:
    """Seconds a target may go on after its first failing example (shrinking, replays) before the run stops with the
    smallest failure so far (``SPEC_SHRINK_DEADLINE``, default 120)."""
    return float(os.environ.get("SPEC_SHRINK_DEADLINE", "120"))


class _BudgetSpent(BaseException):
    """Ends a target's hypothesis run (a BaseException: hypothesis does not catch it) once its fault budget or its
    shrink deadline is spent; carries the smallest failing example's exception so far."""

    def __init__(self, why: str, failure: BaseException):
        super().__init__(why)
        self.why, self.failure = why, failure

#: The seeds' worked examples (verl PRs #6345, #6386), pinned on every invariant.
SEED_CASES = (
    EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=1.0),
    EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=(0.5, 2.0), calculate_entropy=True,
               distillation_keys=("distillation_losses", "student_mass")),
)
#: reach floors: one case per index-width band of the vocabulary (ids above 255 below 32,768; above 32,767 below
#: 65,536; above 65,535), run by every engine-case invariant beside the generated ones, since hypothesis's draws of a
#: rare tier are far from their nominal share (a band can get no case in a 100-example run); real tokenizer sizes;
#: likewise the long tier (3/32 of the draws: a run of a quiet long-row bug found it at its 59th example)
REACH_CASES = (
    EngineCase(prompt_lens=(3, 2), response_lens=(2, 3), vocab=32_000),
    EngineCase(prompt_lens=(4, 2), response_lens=(3, 4), vocab=50_257),
    EngineCase(prompt_lens=(2,), response_lens=(3,), vocab=152_064),
    # and one row longer than 2,048 tokens (a rotary table's, a 2,048-token buffer's edge), beside a short one
    EngineCase(prompt_lens=(1025, 2), response_lens=(1100, 1), vocab=16),
)
SEED_DENSE = (
    DenseCase(prompt_lens=(3, 2), response_lens=(2, 1), prompt_width=3, response_width=2, topk=2),
    DenseCase(prompt_lens=(2, 2), response_lens=(1, 1), prompt_width=2, response_width=1, mrope=True),
    DenseCase(prompt_lens=(2,), response_lens=(3,), prompt_width=2, response_width=3, mrope=True),
    # router replay as a large MoE model hands it: 384 experts (above uint8), one MoE layer, top-8, int16 (verl's
    # agent loop)
    DenseCase(prompt_lens=(2, 1), response_lens=(1, 2), prompt_width=2, response_width=2, routed_experts=384,
              routed_layers=1, routed_topk=8, routed_dtype="int16"),
)


@dataclass
class Outcome:
    invariant: str
    engine: str
    mode: str
    device: str
    #: pass | fail (a check's assertion, or the engine raised) | error (the suite itself failed) | skip
    #: | xfail (only known failures fired) | xpass (a known-failure record never fired: stale)
    status: str
    examples: int = 0
    exercised: int = 0  # examples on which the property was exercised (not marked ctx.not_exercised)
    distinct_cases: int = 0
    known_hits: int = 0  # examples excused by a known-failure record (the run went on)
    seconds: float = 0.0
    counterexample: str | None = None  # the minimal falsifying case, as hypothesis reports it
    error: str | None = None
    reason: str | None = None
    layout: bool = False  # a layout-profile invariant: reported apart, never part of the verdict
    #: per applicable known-failure record: its key, condition, hits
    known: list[dict] = field(default_factory=list)
    #: further distinct failures hypothesis reported (each its own minimal case)
    other_failures: list[dict] = field(default_factory=list)
    #: the shrunk counterexample itself (an EngineCase or DenseCase), for its reproducer (spec/repro); not in JSON
    case: Any = field(default=None, repr=False, compare=False)
    #: per known-failure record that fired: (the first case it excused, the message); not in JSON
    known_cases: dict = field(default_factory=dict, repr=False, compare=False)
    #: dimension -> value -> examples that had it (``spec.cases.coverage.dimensions``)
    coverage: dict[str, dict[str, int]] = field(default_factory=dict)
    #: who the failure is on: "check" (an invariant's assertion), "engine fault" (a malformed output, a rank that
    #: died or hung: spec.execute.attribution.EngineFault), "engine raised", "suite" (the suite's own code, on well
    #: formed engine output); None when nothing failed
    blame: str | None = None
    #: the run's bounds under faults: rank faults seen and allowed, rank-pool restarts, the shrink deadline, and why
    #: the run stopped early (None: it did not)
    budget: dict = field(default_factory=dict)

    @property
    def rejected_by_check(self) -> bool:
        """A failed check (an assertion an invariant makes) with its counterexample: not the engine raising
        (``engine raised ...``, its own ``assert`` included), a suite error, or a known failure."""
        return self.status == "fail" and bool(self.counterexample) and self.blame in ("check", "engine fault")

    @property
    def test_id(self) -> str:
        return f"{self.invariant}-{self.engine}-{self.mode}-{self.device}"

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("case", None)
        data.pop("known_cases", None)
        return {**data, "test_id": self.test_id}


def instances(infos=None) -> list[tuple[InvariantInfo, str]]:
    """Every (invariant, mode) pair of the catalogue, in ID order."""
    infos = infos if infos is not None else [CATALOGUE[k] for k in sorted(CATALOGUE)]
    return [(info, mode) for info in infos for mode in info.modes]


def skip_reason(info: InvariantInfo, engine: EngineUnderTest, device: str, mode: str | None = None) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if mode is not None and mode_reason(info, engine, mode):  # a mode the engine's profile does not run
        return mode_reason(info, engine, mode)
    convention = convention_skip(info, engine)  # one engine's convention, not the contract
    if convention:
        return convention
    for need in info.needs:
        reason = engine.lacks(need) or _real_ranks_unavailable(engine, need)
        if reason:
            return reason
    # e.g. verl-megatron: its packing only, no engine object (spec.protocol.Feature.ENGINE)
    implied = getattr(engine, "implied_needs", None)
    reason = implied(tuple(info.needs)) if implied is not None else None
    # an invariant that names the functions it calls (the micro-batch layer's) is skipped where one is missing
    extra = getattr(info, "skip_reason_for", None)
    return reason or (extra(engine) if extra is not None else None)


def runs_on_ranks(info: InvariantInfo, engine: EngineUnderTest) -> bool:
    """Whether ``info``'s check runs ``engine`` on real ranks (the rank pool): it needs them, or it needs
    sequence parallelism and the engine's runs on a process group."""
    return "real_ranks" in info.needs or ("sp" in info.needs and bool(getattr(engine, "sp_on_real_ranks", False)))


def _real_ranks_unavailable(engine: EngineUnderTest, need: str) -> str | None:
    """For an engine whose sequence parallelism runs on real ranks: why they cannot run here, or None."""
    if need not in ("sp", "real_ranks") or not engine.sp_on_real_ranks:
        return None
    reason = ranks.unavailable("cpu", 2)
    return None if reason is None else (
        f"{engine.name} runs sequence parallelism through a torch.distributed process group, "
        f"and real ranks cannot run here: {reason}")


def _seed_examples(info: InvariantInfo, mode: str, engine: EngineUnderTest | None = None) -> list:
    """The pinned cases every invariant also runs (the seeds' worked examples, the reach floors), minus those the engine's strategy limits exclude (an
    engine that offers no distillation is not handed a distillation case here either)."""
    if info.kind == "dense":
        return [honour_engine(case, engine) for case in SEED_DENSE] if engine is not None else list(SEED_DENSE)
    pinned = getattr(info, "pinned", None)  # invariants on other case types pin their own worked examples
    if pinned is not None:
        return [info.adjust(case) if info.adjust else case for case in pinned(mode, engine)]
    limits = {**(engine.strategy_limits() if engine is not None else {}), **info.strategy_kwargs}
    cases = []
    for case in (*SEED_CASES, *REACH_CASES):
        if not within_limits(case, **limits):
            continue
        if mode in ("packed", "padded"):
            case = case.with_(use_remove_padding=mode == "packed")
        if limits.get("padding") and case.use_remove_padding and limits.get("allow_bucket", True) \
                and case.pad_to_length is None:  # an invariant on padding: a packed tail to poison, as drawn
            case = case.with_(pad_to_length=8 if case.total_nnz % 8 else 9, distillation_keys=(), distillation_only=False)
        if info.head != case.head:
            case = case.with_(head=info.head, temperature=1.0, distillation_keys=(), calculate_entropy=False)
        case = info.adjust(case) if info.adjust else case
        cases.append(honour_engine(case, engine) if engine is not None else case)
    return cases


def _one_line(exc: BaseException) -> str:
    return describe(exc)


def _kind(exc: BaseException) -> str:
    """``fail`` for a check's assertion or anything the engine's own call raised; ``error`` for the suite's."""
    if origin(exc) == ENGINE:
        return "fail"
    if isinstance(exc, AssertionError) and origin(exc) is None:
        return "fail"
    return "error"


def _mark(exc: BaseException, case, kind: str) -> None:
    """Remember on the exception itself which case raised it: the exception hypothesis finally raises
    comes from its last replay, the minimal example, so its case is the shrunk counterexample."""
    try:
        exc._spec_case = repr(case)  # type: ignore[attr-defined]
        exc._spec_case_obj = case  # type: ignore[attr-defined]
        exc._spec_kind = kind  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass


#: the module's ``_mark``, by a name ``run_invariant``'s own ``_mark`` (which ``body`` calls) does not shadow
mark_case = _mark


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _fault(exc: BaseException, kind: type = EngineFault) -> BaseException | None:
    """The ``kind`` (an :class:`EngineFault`) behind ``exc``: itself, or one a check's assertion re-raised with
    context (a real-rank check names the SP group: ``raise AssertionError(...) from fault``)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, kind):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def _blame(exc: BaseException, kind: str) -> str:
    if kind == "error":
        return "suite"
    if origin(exc) == ENGINE:
        return "engine raised"
    return "engine fault" if isinstance(exc, AssertionError) and _fault(exc) is not None else "check"


def _message(exc: BaseException, kind: str) -> str:
    if kind == "error":
        cause = exc.__cause__ if isinstance(exc, SuiteError) and exc.__cause__ is not None else exc
        return (f"suite error: {describe(exc) if cause is exc else describe(exc) + ' <- ' + describe(cause)} "
                "(in the suite's own code; the engine's outputs were well formed)")
    if origin(exc) == ENGINE:  # an engine's own ``assert`` included: never read as a check's failed assertion
        return f"engine raised {describe(exc)}"
    if isinstance(exc, AssertionError) and _fault(exc) is not None:  # a malformed output, a dead or hung rank
        return f"engine fault (failed check): {describe(exc)}"
    return describe(exc)


def _capped(info: InvariantInfo, parent: settings) -> dict:
    """An invariant may cap its share of a profile's examples (``example_share``: the micro-batch layer's, whose
    every example cuts a whole mini-batch): ``max_examples`` scaled by it, at least 10."""
    share = getattr(info, "example_share", None)
    return {} if not share else {"max_examples": max(10, int(parent.max_examples * share))}


def stream_key(info: InvariantInfo, mode: str) -> bytes:
    """Each invariant x mode has its own seed stream (and example-database key): under
    ``derandomize`` hypothesis seeds from the test's digest, which this key enters."""
    return f"{info.id}/{mode}".encode()


def run_invariant(info: InvariantInfo, engine: EngineUnderTest, mode: str, device: str = "cpu", *,
                  profile: str | None = None, shrink: bool = True, seed: int | None = None,
                  explicit: bool = True, **setting_overrides) -> Outcome:
    """Check ``info`` on ``engine`` under ``profile`` (default: the loaded one) plus overrides.

    ``shrink=False`` stops at the first failing example (enough to know a bug is rejected).
    ``seed``: an explicit seed (combined with the invariant's stream key), for independent runs.
    """
    outcome = Outcome(info.id, engine.name, mode, device, "pass", layout=info.layout)
    reason = skip_reason(info, engine, device, mode)
    if reason:
        outcome.status, outcome.reason = "skip", reason
        return outcome
    records = applicable(as_records(engine.known_failures), info.id, mode)
    hits = [0] * len(records)
    state: dict = {"n": 0, "exercised": 0, "cases": set()}
    attributed = AttributedEngine(engine)
    # ``body``'s source is hypothesis's example-database key and, derandomized, the seed of every drawn case:
    # keep it byte for byte. The bookkeeping of which examples passed under a record's condition hooks in
    # through the two names it calls, ``Ctx`` and ``matching``, bound here.
    #: per record, examples that passed (and exercised the property) although its condition held: evidence
    #: that the failure is gone
    passed_under = [0] * len(records)
    current: list = []  # [context, failed] of the running example, settled when the next starts or the run ends

    def settle() -> None:
        """Count the finished example; its context (and the run it cached) is dropped here."""
        if current:
            ctx, failed = current.pop()
            if not failed and ctx.vacuous is None:
                for i, record in enumerate(records):
                    passed_under[i] += bool(record.when(ctx.case))

    seen: Counter = Counter()  # (dimension, value) -> examples
    space = tuple(getattr(engine, "config_space", tuple)())

    def Ctx(*args):  # noqa: N802 - shadows the check context class for ``body`` (see above)
        spent(None)  # a target whose fault budget or shrink deadline is spent stops before its next example
        settle()
        seen.update(dimensions(args[1], space))
        ctx = CheckContext(*args)
        current.append([ctx, False])
        return ctx

    def matching(candidates, case, exc):
        current[-1][1] = True  # every exception of a check passes through here
        record = match_record(candidates, case, exc, engine)  # only what the engine's declarations allow
        if record is not None and record.key not in outcome.known_cases:  # its first case, for a reproducer
            outcome.known_cases[record.key] = (case, _one_line(exc))
        return record

    example_log: list = []  # the running example's attribution log (its engine faults), kept past its ``with``

    @contextmanager
    def recording():  # shadows attribution.recording for ``body`` (see above): keeps the log for ``_mark``
        with record_attribution() as log:
            example_log[:] = [log]
            yield log

    def _mark(exc: BaseException, case, kind: str) -> None:  # shadows the module's ``_mark`` for ``body``
        """Remember the failing case on the exception; a suite crash (or a check that caught one) on an output the
        engine returned malformed is the engine's failed check: its fault is raised instead. Then the bounds."""
        faults = example_log[0].faults if example_log else []
        if kind == "error" and faults:  # the suite crashed reading a malformed output: the engine's failure
            mark_case(faults[0], case, "fail")
            spent(faults[0])
            raise faults[0] from exc
        mark_case(exc, case, kind)
        spent(exc)

    def body(case):
        state["n"] += 1
        state["cases"].add(repr(case))
        ctx = Ctx(attributed, case, device, mode)
        with recording() as log:
            try:
                info.check(ctx)
            except HypothesisException:
                raise
            except Exception as exc:
                if ctx.vacuous is None:  # a failing example exercised the property
                    state["exercised"] += 1
                record = matching(records, case, exc)
                if record is not None:  # excused: count it and go on, so other bugs are still found
                    hits[records.index(record)] += 1
                    return
                _mark(exc, case, _kind(exc))
                raise
            swallowed = log.unhandled_suite()
        if swallowed:  # the check passed only because it caught what the suite itself raised
            where, cause = swallowed[0]
            err = SuiteError(f"the check passed although the suite's {where} raised {describe(cause)}")
            _mark(err, case, "error")
            raise err from cause
        if ctx.vacuous is None:
            state["exercised"] += 1

    body._hypothesis_internal_add_digest = stream_key(info, mode)  # type: ignore[attr-defined]

    faults_allowed, deadline_s, restarts_before = fault_budget(), shrink_deadline(), ranks.restarts()
    bounds = {"faults": 0, "faults_allowed": faults_allowed, "shrink_deadline_s": deadline_s, "stopped": None}
    first_failure: list[float] = []  # seconds into the target of its first failing example (not reported: a timing)
    failures: list[BaseException] = []  # the latest failing example's exception (hypothesis shrinks towards it)

    def spent(exc: BaseException | None) -> None:
        """Stop the target once its rank faults reach the budget, or after a failure its rank pool was restarted more
        often than that, or its shrink deadline passed since the first failure (a crashing example is slow to replay:
        each replaces the rank pool), with the latest failure."""
        now = time.perf_counter()
        if exc is not None:
            failures[:] = [exc]
            if not first_failure:
                first_failure.append(now - start)
            if _fault(exc, ranks.RankFault) is not None:
                bounds["faults"] += 1
                if bounds["faults"] >= faults_allowed:
                    raise _BudgetSpent(f"fault budget spent: {bounds['faults']} examples ended in a rank fault "
                                       f"(SPEC_FAULT_BUDGET={faults_allowed}); shrinking stopped", exc) from exc
        restarted = ranks.restarts() - restarts_before
        if failures and restarted > faults_allowed:  # ranks left hanging in a collective by a failure: each restarts
            raise _BudgetSpent(f"the rank pool was restarted {restarted} times (more than SPEC_FAULT_BUDGET="
                               f"{faults_allowed}); shrinking stopped", failures[0])
        if failures and first_failure and now - start - first_failure[0] > deadline_s:
            raise _BudgetSpent(f"shrink deadline spent: {deadline_s:g} s after the first failure "
                               f"(SPEC_SHRINK_DEADLINE); shrinking stopped", failures[0])

    def prop(phases):
        test = given(case=info.cases(mode, engine))(body)
        for case in reversed(_seed_examples(info, mode, engine)):
            test = example(case=case)(test)
        if seed is not None:
            test = hypothesis_seed(zlib.crc32(stream_key(info, mode)) ^ seed)(test)
        return settings(parent, phases=phases, **{**_capped(info, parent), **setting_overrides})(test)

    parent = settings.get_profile(profile) if profile is not None else settings.default
    # Generated examples first (so a failure is reported shrunk), then the pinned seed examples.
    generated = tuple(p for p in parent.phases if p != Phase.explicit and (shrink or p != Phase.shrink))
    start = time.perf_counter()
    # explicit=False (fuzz campaigns): generated cases only, so every failure found is saved to the database
    for phases in (generated, (Phase.explicit,)) if explicit else (generated,):
        try:
            prop(phases)()
        except _BudgetSpent as stop:  # the smallest failure so far, reported as it is, with why the run stopped
            bounds["stopped"] = stop.why
            _record_failure(outcome, stop.failure)
            outcome.error = f"{outcome.error} [{stop.why}]"  # the report says the run was bounded, and by what
            break
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its minimal case
            _record_failure(outcome, exc)
            break
    outcome.seconds = time.perf_counter() - start
    outcome.budget = {**bounds, "pool_restarts": ranks.restarts() - restarts_before}
    outcome.examples = state["n"]
    outcome.exercised = state["exercised"]
    outcome.distinct_cases = len(state["cases"])
    outcome.known_hits = sum(hits)
    settle()
    for (dim, value), count in sorted(seen.items()):
        outcome.coverage.setdefault(dim, {})[value] = count
    outcome.known = [{"key": r.key, "when": r.when.text, "hits": h, "passed_under": p, "certain": r.certain,
                      "reason": r.reason}
                     for r, h, p in zip(records, hits, passed_under)]
    if records and outcome.status == "pass":
        # stale: never fired although examples under its condition ran and passed; a record whose condition no
        # example met was not reached (no evidence either way), which the report shows as 0 hits
        stale = [r for r, h, p in zip(records, hits, passed_under) if not h and p and r.certain]
        reached = [(r, h) for r, h, p in zip(records, hits, passed_under) if h or (p and r.certain)]
        if stale:
            outcome.status = "xpass"
            outcome.reason = "stale known failure (never fired): " + "; ".join(r.describe() for r in stale)
        elif reached:
            outcome.status = "xfail"
            outcome.reason = "; ".join(f"{r.reason} [{h} hits when {r.when.text}]" for r, h in zip(records, hits))
    return outcome


def _record_failure(outcome: Outcome, exc: BaseException) -> None:
    """The status, minimal counterexample and message of a failed run (a real failure beats a suite error)."""
    marked = [e for e in _leaves(exc) if hasattr(e, "_spec_case")]
    if not marked:  # hypothesis itself gave up (health check, flakiness): the suite failed
        outcome.status, outcome.error, outcome.blame = "error", f"suite error: {describe(exc)}", "suite"
        return
    marked.sort(key=lambda e: e._spec_kind != "fail")  # type: ignore[attr-defined]
    first, *rest = marked
    outcome.status = first._spec_kind  # type: ignore[attr-defined]
    outcome.blame = _blame(first, outcome.status)
    outcome.counterexample = first._spec_case  # type: ignore[attr-defined]
    outcome.case = getattr(first, "_spec_case_obj", None)
    outcome.error = _message(first, outcome.status)
    outcome.other_failures = [{"status": e._spec_kind, "counterexample": e._spec_case,  # type: ignore[attr-defined]
                               "error": _message(e, e._spec_kind)} for e in rest]  # type: ignore[attr-defined]
