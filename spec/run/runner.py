"""Runs catalogue entries against an engine with hypothesis; one code path for pytest and the CLI."""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from hypothesis import Phase, example, given, seed as hypothesis_seed, settings
from hypothesis.errors import HypothesisException

from ..execute import ranks
from ..execute.attribution import (ENGINE, AttributedEngine, EngineFault, MissingDependency, SuiteError, describe,
                                   origin)
from ..execute.attribution import recording as record_attribution
from ..execute.memo import Runs

from ..cases.coverage import dimensions
from ..cases.structure import DenseCase, EngineCase, Media
from ..protocol.engine import EngineUnderTest
from ..protocol.profile import MODES, profile_of
from ..cases.strategies import with_pinned_switches, within_limits
from ..invariants import CATALOGUE, Ctx as CheckContext, InvariantInfo
from ..invariants.core import convention_skip, honour_engine, media_within_profile, mode_reason
from ..protocol.errors import BudgetSpent, Failures, InvalidRecord, StreamDone
from ..protocol.known import KnownFailure, applicable, as_records, excusing, parts_of, unexcused, unmatchable

__all__ = ["Outcome", "instances", "skip_reason", "implied_reason", "run_invariant", "run_group", "runs_on_ranks", "SEED_CASES",
           "DEVICES", "fault_budget", "shrink_deadline", "stream_key", "stream_seed", "TargetRun", "StreamRun",
           "InvalidRecord", "record_problems", "check_records"]

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
    # a vision-language micro-batch (engines whose profile lists media): two images and a video over three samples,
    # one of them text-only, unequal grids (spec.truth.vision)
    EngineCase(prompt_lens=(5, 2, 7), response_lens=(2, 1, 3), vocab=16, mrope=True,
               media=((Media("image", 1, 2, 4, 1),), (), (Media("video", 2, 2, 2, 0), Media("image", 1, 4, 2, 1)))),
    # a micro-batch whose media are all videos (a video dataset's), beside a text-only sample: a library that keys its
    # media handling by the images' keys alone takes it wrong (OpenRLHF's VIDEO_ONLY record: found by a database
    # example, never by a derandomized run); an image-only engine gets it as text
    EngineCase(prompt_lens=(6, 3), response_lens=(2, 2), vocab=16, mrope=True,
               media=((Media("video", 2, 2, 2, 0),), ())),
    # an audio micro-batch (engines whose profile lists audio; no other engine runs it): three clips over three
    # samples, one text-only, of 5, 4 and 7 frames (a sample's clips padded to its longest, the samples' to the
    # batch's: spec.truth.audio)
    EngineCase(prompt_lens=(5, 2, 7), response_lens=(2, 1, 3), vocab=16,
               media=((Media("audio", gap=1, frames=5),), (), (Media("audio", frames=4), Media("audio", gap=1, frames=7)))),
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
    #: | unexercised (examples ran, none exercised the property: never a pass; docs/verdict.md)
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
    #: formed engine output), "environment" (the engine's library imports a module not installed here:
    #: spec.execute.attribution.MissingDependency); None when nothing failed
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


def implied_reason(info: InvariantInfo, engine: EngineUnderTest) -> str | None:
    """Why ``info`` cannot run on ``engine`` beyond its needs (``EngineUnderTest.implied_needs``: e.g. verl-megatron,
    its packing only, no engine object). A micro-batch check runs the layer alone, also one bridged to step layers
    (INV-MB-001/006/007/008 drop the ``microbatch`` need; their ``skip_reason_for`` decides)."""
    implied = getattr(engine, "implied_needs", None)
    needs = (*info.needs, "microbatch") if getattr(info, "kind", None) == "microbatch" else tuple(info.needs)
    return implied(tuple(dict.fromkeys(needs))) if implied is not None else None


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
    lacking = [engine.lacks(need) for need in info.needs_any]
    if lacking and all(lacking):
        return "; ".join(dict.fromkeys(lacking))
    reason = implied_reason(info, engine)
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
    limits.setdefault("media", profile_of(engine).media if engine is not None else ())
    limits.setdefault("media_modes", profile_of(engine).media_modes if engine is not None else MODES)
    limits.setdefault("mrope_modes", profile_of(engine).mrope_modes if engine is not None else MODES)
    cases = []
    for case in (*SEED_CASES, *REACH_CASES, *(profile_of(engine).reach_cases if engine is not None else ())):
        if mode in ("packed", "padded"):
            case = case.with_(use_remove_padding=mode == "packed")
        if engine is not None:  # an image-only engine gets the reach case's images; an engine without audio no clips
            if case.has_audio and "audio" not in profile_of(engine).media:
                continue
            case = media_within_profile(case, profile_of(engine))
        if not within_limits(case, **limits):
            continue
        if limits.get("padding") and case.use_remove_padding and limits.get("allow_bucket", True) \
                and case.pad_to_length is None:  # an invariant on padding: a packed tail to poison, as drawn
            case = case.with_(pad_to_length=8 if case.total_nnz % 8 else 9, distillation_keys=(), distillation_only=False)
        if info.head != case.head:
            case = case.with_(head=info.head, temperature=1.0, distillation_keys=(), calculate_entropy=False)
        if engine is not None:  # the engine's tail rule on (INV-PAD-003), its routed experts collated (INV-ROUTE-001)
            case = with_pinned_switches(case, tuple(engine.config_space()), tail_rule=bool(limits.get("pin_tail_rule")),
                                        routes=limits.get("pin_routes", False))
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


#: the name the stream's bookkeeping marks a failing case by
mark_case = _mark


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _fault(exc: BaseException, kind: type = EngineFault) -> BaseException | None:
    """The ``kind`` (an :class:`EngineFault`) behind ``exc``: itself, or one a check's assertion re-raised with
    context (a real-rank check names the SP group: ``raise AssertionError(...) from fault``)."""
    for part in getattr(exc, "parts", None) or ():  # a check that reported several facts: a fault among them
        found = _fault(part, kind)
        if found is not None:
            return found
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
        return "environment" if isinstance(exc, MissingDependency) else "suite"
    if origin(exc) == ENGINE:
        return "engine raised"
    return "engine fault" if isinstance(exc, AssertionError) and _fault(exc) is not None else "check"


def _message(exc: BaseException, kind: str) -> str:
    if isinstance(exc, MissingDependency):  # the environment lacks a module the library imports: no verdict either way
        return f"{exc} (an environment error: no verdict on the engine)"
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
    """The seed stream (and example-database key) of a target: its invariant's :meth:`~InvariantInfo.stream`, shared
    by every target that draws the same strategy (the shared runs of spec/run/groups.py: a target draws the same
    cases alone as in its group), else its own ``ID/mode``. Derived from this key alone, never from the runner's
    source text, so a change to the runner re-seeds nothing."""
    return (info.stream(mode) or f"{info.id}/{mode}").encode()


def stream_seed(key: bytes, seed: int | None = None) -> int:
    """The hypothesis seed of stream ``key``: a digest of the key (sha384), mixed with ``seed`` for independent
    runs (fuzz campaigns, the detection table)."""
    base = int.from_bytes(hashlib.sha384(key).digest()[:16], "big")
    return base if seed is None else base ^ (seed & (2 ** 128 - 1))


def record_problems(records: Any) -> list[str]:
    """Why each of ``records`` (an engine's ``known_failures``) could never match, one line each (none: every record
    can)."""
    problems = []
    for record in as_records(records):
        info = CATALOGUE.get(record.invariant)
        if info is None:
            problems.append(f"{record.describe()}: no invariant {record.invariant} (python -m spec list)")
            continue
        why = unmatchable(record, info.facts, info.modes)
        if why:
            problems.append(why)
    return problems


def check_records(engine: EngineUnderTest) -> None:
    """:class:`InvalidRecord` naming every record of ``engine`` that could never match (:func:`record_problems`)."""
    problems = record_problems(engine.known_failures)
    if problems:
        raise InvalidRecord(f"{engine.name}: {len(problems)} known-failure record(s) could never match: "
                            + "; ".join(problems))


class TargetRun:
    """One invariant x mode's bookkeeping over the examples of the stream that feeds it: examples run and
    exercised, the known-failure records that excused one, the examples that passed under a record's condition
    (evidence that the failure is gone), the drawn dimensions, and its first failure. :meth:`finish` fills its
    :class:`Outcome`."""

    def __init__(self, info: InvariantInfo, engine: EngineUnderTest, mode: str, device: str):
        self.info, self.engine, self.mode, self.device = info, engine, mode, device
        self.outcome = Outcome(info.id, engine.name, mode, device, "pass", layout=info.layout)
        self.records = applicable(as_records(engine.known_failures), info.id, mode)
        problems = record_problems(self.records)
        if problems:
            raise InvalidRecord(f"{engine.name}: " + "; ".join(problems))
        self.hits = [0] * len(self.records)
        self.passed_under = [0] * len(self.records)
        self.examples = self.exercised = 0
        self.cases: set[str] = set()
        self.seen: Counter = Counter()  # (dimension, value) -> examples
        self.vacuous: Counter = Counter()  # why an example did not exercise the property -> examples
        self.space = tuple(getattr(engine, "config_space", tuple)())
        self.current: list = []  # [context, failed] of the running example, settled when the next starts or at the end
        #: in a group: the failure that took it out of the stream (its case marked on it), None while it passes
        self.failure: BaseException | None = None

    def settle(self) -> None:
        """Count the finished example; its context (and the run it cached) is dropped here."""
        if self.current:
            ctx, failed = self.current.pop()
            if not failed and ctx.vacuous is None:
                for i, record in enumerate(self.records):
                    self.passed_under[i] += bool(record.when(ctx.case))
            if ctx.vacuous is not None:
                self.vacuous[ctx.vacuous] += 1

    def context(self, engine: EngineUnderTest, case: Any, shared: dict, runs: Runs) -> CheckContext:
        """The next example's check context, holding what an earlier check of the same case computed (``shared``:
        the oracle, the read positions) and the example's engine runs (``runs``: every check's, by call)."""
        self.settle()
        self.examples += 1
        self.cases.add(repr(case))
        self.seen.update(dimensions(case, self.space))
        ctx = CheckContext(engine, case, self.device, self.mode, runs)
        ctx.__dict__.update(shared)
        self.current.append([ctx, False])
        return ctx

    def excused(self, case: Any, exc: BaseException) -> bool:
        """Whether known-failure records (only what the engine's declarations allow) excuse ``exc`` on ``case``,
        every failing fact of it (a record excuses only the facts it names: ``spec.protocol.known.excusing``): then
        each record is counted and the run goes on, so other bugs are still found."""
        self.current[-1][1] = True
        found = excusing(self.records, case, exc, self.engine)
        if found is None:
            return False
        for record, part in dict(zip(found, parts_of(exc))).items():  # each record once per example
            if record.key not in self.outcome.known_cases:  # its first case, for a reproducer
                self.outcome.known_cases[record.key] = (case, _one_line(part))
            self.hits[self.records.index(record)] += 1
        return True

    def unexcused(self, case: Any, exc: BaseException) -> BaseException:
        """What of ``exc`` no record excuses: the failure itself, or of a check that reported several facts
        (:class:`~spec.invariants.core.Failures`) those no record excuses (one alone as itself)."""
        if not getattr(exc, "parts", None):
            return exc
        left = unexcused(self.records, case, exc, self.engine)
        return exc if len(left) == len(exc.parts) else left[0] if len(left) == 1 else Failures(left)

    def finish(self, seconds: float, budget: dict) -> Outcome:
        outcome = self.outcome
        self.settle()
        outcome.seconds, outcome.budget = seconds, budget
        outcome.examples, outcome.exercised, outcome.distinct_cases = self.examples, self.exercised, len(self.cases)
        outcome.known_hits = sum(self.hits)
        for (dim, value), count in sorted(self.seen.items()):
            outcome.coverage.setdefault(dim, {})[value] = count
        records = self.records
        outcome.known = [{"key": r.key, "when": r.when.text, "hits": h, "passed_under": p, "certain": r.certain,
                          "reason": r.reason} for r, h, p in zip(records, self.hits, self.passed_under)]
        if records and outcome.status == "pass":
            # stale: never fired although examples under its condition ran and passed; a record whose condition no
            # example met was not reached (no evidence either way), which the report shows as 0 hits
            stale = [r for r, h, p in zip(records, self.hits, self.passed_under) if not h and p and r.certain]
            reached = [r for r, h, p in zip(records, self.hits, self.passed_under) if h or (p and r.certain)]
            if stale:
                outcome.status = "xpass"
                outcome.reason = "stale known failure (never fired): " + "; ".join(r.describe() for r in stale)
            elif reached:
                outcome.status = "xfail"
                outcome.reason = "; ".join(f"{r.reason} [{h} hits when {r.when.text}]"
                                           for r, h in zip(records, self.hits))
        if outcome.status == "pass" and not self.exercised:  # no example showed the property: never a pass
            outcome.status = "unexercised"
            why = "; ".join(f"{reason} ({n} examples)" for reason, n in self.vacuous.most_common(3))
            outcome.reason = f"not exercised: {why or 'no example ran'}"
        return outcome


class _Pinned:
    """An explicit example of a stream: each member's own pinned case (None: that member has fewer)."""

    def __init__(self, cases: tuple):
        self.cases = cases

    def __repr__(self) -> str:
        return "pinned(" + ", ".join(repr(c) for c in self.cases if c is not None) + ")"


#: the check context's cached values that one case's checks share (the oracle, the read positions, the micro-batch);
#: the engine's runs are shared by call, the reruns of variants too (:class:`~spec.execute.memo.Runs`)
SHARED = ("expected", "read", "batch")


class StreamRun:
    """One hypothesis run over a case stream, feeding the checks of one or more targets (:class:`TargetRun`).

    Alone, a target's failure is raised to hypothesis, which shrinks it. In a group (spec/run/groups.py) each drawn
    case is shaped for every member (its adjustment, the engine's), one engine run per distinct shaped case feeds
    every check that reads it, and a member's failure takes it out of the stream (the others go on); the runner
    then runs that member alone, where its failure shrinks (:func:`run_group`). The run's bounds under faults
    (the fault budget, the shrink deadline, rank-pool restarts) are the stream's."""

    def __init__(self, members: list[TargetRun], engine: EngineUnderTest, device: str, mode: str):
        self.members, self.active = members, list(members)
        self.alone = len(members) == 1
        self.engine, self.attributed, self.device, self.mode = engine, AttributedEngine(engine), device, mode
        self.faults_allowed, self.deadline_s, self.restarts_before = fault_budget(), shrink_deadline(), ranks.restarts()
        self.bounds = {"faults": 0, "faults_allowed": self.faults_allowed, "shrink_deadline_s": self.deadline_s,
                       "stopped": None}
        self.first_failure: list[float] = []  # seconds into the run of its first failing example (not reported)
        self.failures: list[BaseException] = []  # the latest failing example's exception (hypothesis shrinks to it)
        self.log: list = []  # the running check's attribution log (its engine faults), kept past its ``with``
        self.start = time.perf_counter()

    def example(self, drawn: Any) -> None:
        """hypothesis's test body: every active member checks its shape of ``drawn``."""
        self.spent(None)  # a run whose fault budget or shrink deadline is spent stops before its next example
        shared: dict[str, dict] = {}  # shaped case -> what its first check computed
        runs = Runs(shared=not self.alone)  # the example's engine runs, by call: each made once for every check
        for n, member in enumerate(self.members):
            if member not in self.active:
                continue
            case = drawn.cases[n] if isinstance(drawn, _Pinned) else member.info.shaped(drawn, self.engine)
            if case is not None:
                self.check(member, case, shared.setdefault(repr(case), {}), runs)
        if not self.active:
            raise StreamDone()

    def check(self, member: TargetRun, case: Any, shared: dict, runs: Runs) -> None:
        ctx = member.context(self.attributed, case, shared, runs)
        with record_attribution() as log:
            self.log[:] = [log]
            try:
                member.info.check(ctx)
            except HypothesisException:
                raise
            except Exception as exc:
                if ctx.vacuous is None:  # a failing example exercised the property
                    member.exercised += 1
                if not member.excused(case, exc):
                    exc = member.unexcused(case, exc)
                    self.failed(member, exc, case, _kind(exc))
                return
            finally:
                shared.update({name: ctx.__dict__[name] for name in SHARED if name in ctx.__dict__})
            swallowed = log.unhandled_suite()
        if swallowed:  # the check passed only because it caught what the suite itself raised
            where, cause = swallowed[0]
            err = SuiteError(f"the check passed although the suite's {where} raised {describe(cause)}")
            err.__cause__ = cause
            self.failed(member, err, case, "error")
            return
        if ctx.vacuous is None:
            member.exercised += 1

    def failed(self, member: TargetRun, exc: BaseException, case: Any, kind: str) -> None:
        """Remember the failing case on the exception; a suite crash (or a check that caught one) on an output the
        engine returned malformed is the engine's failed check: its fault stands instead. Then the bounds; alone,
        the failure is raised for hypothesis to shrink, in a group the member leaves the stream."""
        faults = self.log[0].faults if self.log else []
        if kind == "error" and faults:  # the suite crashed reading a malformed output: the engine's failure
            fault = faults[0]
            fault.__cause__, fault.__suppress_context__ = exc, True
            exc, kind = fault, "fail"
        mark_case(exc, case, kind)
        self.spent(exc)
        if self.alone and isinstance(exc, MissingDependency):  # every example would say the same: not shrunk
            raise BudgetSpent("an environment error: not shrunk", exc) from exc
        if self.alone:
            raise exc
        member.failure = exc
        self.active.remove(member)

    def spent(self, exc: BaseException | None) -> None:
        """Stop the run once its rank faults reach the budget, or after a failure its rank pool was restarted more
        often than that, or (alone: shrinking) its shrink deadline passed since the first failure (a crashing example
        is slow to replay: each replaces the rank pool), with the latest failure."""
        now = time.perf_counter()
        allowed = self.faults_allowed
        if exc is not None:
            self.failures[:] = [exc]
            if not self.first_failure:
                self.first_failure.append(now - self.start)
            if _fault(exc, ranks.RankFault) is not None:
                self.bounds["faults"] += 1
                if self.bounds["faults"] >= allowed:
                    raise BudgetSpent(f"fault budget spent: {self.bounds['faults']} examples ended in a rank fault "
                                       f"(SPEC_FAULT_BUDGET={allowed}); shrinking stopped", exc) from exc
        restarted = ranks.restarts() - self.restarts_before
        if self.failures and restarted > allowed:  # ranks left hanging in a collective by a failure: each restarts
            raise BudgetSpent(f"the rank pool was restarted {restarted} times (more than SPEC_FAULT_BUDGET="
                               f"{allowed}); shrinking stopped", self.failures[0])
        if self.alone and self.failures and self.first_failure \
                and now - self.start - self.first_failure[0] > self.deadline_s:
            raise BudgetSpent(f"shrink deadline spent: {self.deadline_s:g} s after the first failure "
                               f"(SPEC_SHRINK_DEADLINE); shrinking stopped", self.failures[0])

    def run(self, strategy, pinned: list[_Pinned], key: bytes, parent: settings, *, shrink: bool, seed: int | None,
            explicit: bool, overrides: dict) -> None:
        """Generated examples first (so a failure is reported shrunk), then the pinned ones; the seed and the
        example-database key from ``key`` alone (:func:`stream_seed`)."""
        def test(case):
            self.example(case)

        generated = tuple(p for p in parent.phases if p != Phase.explicit and (shrink or p != Phase.shrink))
        # explicit=False (fuzz campaigns): generated cases only, so every failure found is saved to the database
        for phases in (generated, (Phase.explicit,)) if explicit else (generated,):
            wrapped = given(case=strategy)(test)
            for case in reversed(pinned):
                wrapped = example(case=case)(wrapped)
            if seed is not None or parent.derandomize:
                wrapped = hypothesis_seed(stream_seed(key, seed))(wrapped)
            wrapped._hypothesis_internal_database_key = hashlib.sha384(b"db/" + key).digest()[:20]
            try:
                settings(parent, phases=phases, **overrides)(wrapped)()
            except StreamDone:
                break
            except BudgetSpent as stop:  # the smallest failure so far, reported as it is, with why the run stopped
                self.bounds["stopped"] = stop.why
                if self.alone:
                    _record_failure(self.members[0].outcome, stop.failure)
                    self.members[0].outcome.error = f"{self.members[0].outcome.error} [{stop.why}]"
                break
            except Exception as exc:  # noqa: BLE001 - every failure is reported, with its minimal case
                if self.alone:
                    _record_failure(self.members[0].outcome, exc)
                else:  # hypothesis itself stopped the group (a health check): each member runs alone, and says why
                    self.bounds["stopped"] = f"the group's run raised {describe(exc)}"
                break

    def finish(self) -> list[Outcome]:
        seconds = (time.perf_counter() - self.start) / len(self.members)  # a group's time, shared by its checks
        budget = {**self.bounds, "pool_restarts": ranks.restarts() - self.restarts_before}
        return [member.finish(seconds, budget) for member in self.members]


def run_invariant(info: InvariantInfo, engine: EngineUnderTest, mode: str, device: str = "cpu", *,
                  profile: str | None = None, shrink: bool = True, seed: int | None = None,
                  explicit: bool = True, also: tuple = (), **setting_overrides) -> Outcome:
    """Check ``info`` on ``engine`` under ``profile`` (default: the loaded one) plus overrides.

    ``shrink=False`` stops at the first failing example (enough to know a bug is rejected).
    ``seed``: an explicit seed (combined with the target's stream key), for independent runs.
    ``also``: further cases pinned for this run (a group's failing case, run again here alone).
    """
    skipped = _skipped(info, engine, mode, device)
    if skipped is not None:
        return skipped
    parent = _profile(profile)
    member = TargetRun(info, engine, mode, device)
    stream = StreamRun([member], engine, device, mode)
    pinned = [_Pinned((case,)) for case in (*_seed_examples(info, mode, engine), *also)]
    stream.run(info.cases(mode, engine).map(lambda case: _Pinned((case,))), pinned, stream_key(info, mode), parent,
               shrink=shrink, seed=seed, explicit=explicit, overrides={**_capped(info, parent), **setting_overrides})
    return stream.finish()[0]


def run_group(pairs: list[tuple[InvariantInfo, str]], engine: EngineUnderTest, device: str = "cpu", *,
              profile: str | None = None, **setting_overrides) -> list[Outcome]:
    """The outcomes of targets that share one case stream (spec/run/groups.py: one :meth:`~InvariantInfo.stream`
    key), in ``pairs``' order: one hypothesis run draws each case once and every member checks its shape of it, one
    engine run per distinct shaped case; pinned examples are every member's own. A member that fails there is run
    again alone (:func:`run_invariant`, its failing case pinned too), so its report holds its own shrunk
    counterexample; a member skipped on this engine is reported skipped."""
    if len(pairs) == 1:
        info, mode = pairs[0]
        return [run_invariant(info, engine, mode, device, profile=profile, **setting_overrides)]
    outcomes: dict[int, Outcome] = {}
    live: list[tuple[int, InvariantInfo, str]] = []
    for n, (info, mode) in enumerate(pairs):
        skipped = _skipped(info, engine, mode, device)
        if skipped is not None:
            outcomes[n] = skipped
        else:
            live.append((n, info, mode))
    if live:
        keys = {stream_key(info, mode) for _, info, mode in live}
        if len(keys) != 1:
            raise ValueError(f"run_group: the targets draw {len(keys)} different streams: {sorted(keys)}")
        parent = _profile(profile)
        mode = live[0][2]
        members = [TargetRun(info, engine, m, device) for _, info, m in live]
        stream = StreamRun(members, engine, device, mode)
        own = [_seed_examples(info, m, engine) for _, info, m in live]
        pinned = [_Pinned(tuple(cases[i] if i < len(cases) else None for cases in own))
                  for i in range(max(map(len, own)))]
        first = live[0][1]
        overrides = dict(setting_overrides)
        stream.run(first.drawn(mode, engine), pinned, keys.pop(), parent, shrink=True, seed=None, explicit=True,
                   overrides=overrides)
        done = stream.finish()
        wanted = settings(parent, **overrides).max_examples
        for (n, info, m), member, outcome, cases in zip(live, members, done, own):
            # alone, a failure shrinks; after a stopped stream, a member short of its examples runs them
            short = bool(stream.bounds["stopped"]) and member.examples < wanted + len(cases)
            if member.failure is not None or short:
                also = (member.failure._spec_case_obj,) if member.failure is not None and getattr(
                    member.failure, "_spec_case_obj", None) is not None else ()
                outcome = run_invariant(info, engine, m, device, profile=profile, also=also, **setting_overrides)
            outcomes[n] = outcome
    return [outcomes[n] for n in range(len(pairs))]


def _skipped(info: InvariantInfo, engine: EngineUnderTest, mode: str, device: str) -> Outcome | None:
    """The skip outcome of a target that does not run on ``engine`` here (with the reason), else None."""
    reason = skip_reason(info, engine, device, mode)
    return None if not reason else Outcome(info.id, engine.name, mode, device, "skip", reason=reason,
                                           layout=info.layout)


def _profile(name: str | None) -> settings:
    """The hypothesis profile ``name``, default the loaded one."""
    return settings.get_profile(name) if name is not None else settings.default


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
